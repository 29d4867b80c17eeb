module node-agent.test/standin/pause

go 1.21
