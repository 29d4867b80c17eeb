// The bed's pod sandbox program, standing in for Kubernetes' pause image: the sandbox's first
// process holds the pod's namespaces by doing nothing, reaps whatever exits under it (PID 1 of a
// shared process namespace), and leaves on SIGINT or SIGTERM, as containerd and the kubelet ask.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(128 + int(sig.(syscall.Signal)))
	}
}
