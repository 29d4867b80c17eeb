// The OSC decoder of upstream gardener-node-agent, reduced to its YAML and JSON steps, at the
// library versions Gardener v1.150.0 builds with (tests/testbed/gardener/go.mod): what it makes of
// a plain scalar is the oracle for node-agent's reader of them (tests/testbed/scalar_cases.py).
module node-agent.test/goyaml-oracle

go 1.23

require (
	go.yaml.in/yaml/v2 v2.4.4
	sigs.k8s.io/json v0.0.0-20250730193827-2d320260d730
	sigs.k8s.io/yaml v1.6.0
)
