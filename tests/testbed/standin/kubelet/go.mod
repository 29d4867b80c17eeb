module node-agent.test/standin/kubelet

go 1.21
