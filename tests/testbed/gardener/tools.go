//go:build tools

// Package tools keeps upstream gardener-node-agent in the module graph.
package tools

import (
	_ "github.com/gardener/gardener/cmd/gardener-node-agent"
)
