//go:build tools

// Package tools keeps the built command in the module graph.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kubelet"
)
