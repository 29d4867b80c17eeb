// Command goyaml-oracle reads plain YAML scalars, one JSON string per line on stdin, and prints
// one JSON object per line on stdout telling how upstream gardener-node-agent's OSC decoder reads
// the document `v: <scalar>`. That decoder is apimachinery's JSON serializer in YAML mode, not
// strict: sigs.k8s.io/yaml's YAMLToJSON without a target, then sigs.k8s.io/json's case-sensitive
// decode into the typed struct. The object holds:
//
//	text         the scalar
//	go_type      the Go type go-yaml v2 gives it, decoded into interface{}
//	json         what YAMLToJSON makes of the document (absent when it fails: "error")
//	string_field the value a string field of the struct gets, or "error: ..."
//	int32_field  the value an int32 field gets, or "error: ..."
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	yamlv2 "go.yaml.in/yaml/v2"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

type stringField struct {
	V string `json:"v"`
}

type int32Field struct {
	V int32 `json:"v"`
}

func read(text string) map[string]any {
	doc := []byte("v: " + text + "\n")
	out := map[string]any{"text": text}
	var loose map[string]any
	if err := yamlv2.Unmarshal(doc, &loose); err != nil {
		out["go_error"] = err.Error()
	} else {
		out["go_type"] = fmt.Sprintf("%T", loose["v"])
	}
	converted, err := yaml.YAMLToJSON(doc)
	if err != nil {
		out["error"] = err.Error()
		return out
	}
	out["json"] = string(converted)
	var s stringField
	if err := kjson.UnmarshalCaseSensitivePreserveInts(converted, &s); err != nil {
		out["string_field"] = "error: " + err.Error()
	} else {
		out["string_field"] = s.V
	}
	var i int32Field
	if err := kjson.UnmarshalCaseSensitivePreserveInts(converted, &i); err != nil {
		out["int32_field"] = "error: " + err.Error()
	} else {
		out["int32_field"] = i.V
	}
	return out
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var text string
		if err := json.Unmarshal(in.Bytes(), &text); err != nil {
			fmt.Fprintln(os.Stderr, "goyaml-oracle: each line must be a JSON string:", err)
			os.Exit(2)
		}
		if err := out.Encode(read(text)); err != nil {
			fmt.Fprintln(os.Stderr, "goyaml-oracle:", err)
			os.Exit(1)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "goyaml-oracle:", err)
		os.Exit(1)
	}
}
