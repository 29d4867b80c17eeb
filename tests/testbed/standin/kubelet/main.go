// A stand-in for kubelet in the test bed: it answers GET /healthz with "ok" on
// 127.0.0.1:10248 (kubelet's defaults, overridable with --healthz-port and
// --healthz-bind-address) and otherwise just runs until it is stopped. Every other
// flag a kubelet unit passes is accepted and ignored, so real unit files work unchanged.
// --healthz-fail-file PATH (the stand-in's own flag): while PATH exists, /healthz answers
// 500 with the file's first line, so a test can make kubelet unhealthy and healthy again
// without stopping it.
package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
)

func main() {
	addr, port, failFile := "127.0.0.1", "10248", ""
	args := os.Args[1:]
	for i := 0; i < len(args); i++ {
		name, value, hasValue := strings.Cut(strings.TrimLeft(args[i], "-"), "=")
		if name == "version" {
			fmt.Println("Kubernetes v0.0.0-standin")
			return
		}
		if name != "healthz-port" && name != "healthz-bind-address" && name != "healthz-fail-file" {
			continue
		}
		if !hasValue && i+1 < len(args) {
			i++
			value = args[i]
		}
		switch name {
		case "healthz-port":
			port = value
		case "healthz-fail-file":
			failFile = value
		default:
			addr = value
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if failFile != "" {
			if reason, err := os.ReadFile(failFile); err == nil {
				line, _, _ := strings.Cut(string(reason), "\n")
				w.WriteHeader(http.StatusInternalServerError)
				_, _ = w.Write([]byte("unhealthy: " + line))
				return
			}
		}
		_, _ = w.Write([]byte("ok"))
	})
	listen := net.JoinHostPort(addr, port)
	fmt.Fprintf(os.Stderr, "stand-in kubelet: serving /healthz on %s (args %q)\n", listen, os.Args[1:])
	if err := http.ListenAndServe(listen, mux); err != nil {
		fmt.Fprintf(os.Stderr, "stand-in kubelet: %v\n", err)
		os.Exit(1)
	}
}
