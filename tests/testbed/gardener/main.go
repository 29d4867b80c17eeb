// Command gardener-gen renders what Gardener itself would send to one worker node of a named
// pool shape, through Gardener's own code: the OperatingSystemConfig component (original and
// nodeinit purposes, deployed into an in-memory client), then the gardener-node-agent Secret
// built from the reconcile OSC. An OS extension's share (its status, registry mirrors) is added
// by hand, as an extension would. The result is one JSON document on stdout.
//
// It must be built with -X k8s.io/component-base/version.gitVersion=<gardener version>, as
// gardenlet is: the agent's config file name and image tag come from it. build-gardener.sh
// builds it against each release of ./releases (one source for all of them).
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/Masterminds/semver/v3"
	machinecontroller "github.com/gardener/machine-controller-manager/pkg/util/provider/machinecontroller"
	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/component-base/version"
	"sigs.k8s.io/controller-runtime/pkg/client"
	fakeclient "sigs.k8s.io/controller-runtime/pkg/client/fake"

	osccontroller "github.com/gardener/gardener/extensions/pkg/controller/operatingsystemconfig"
	"github.com/gardener/gardener/imagevector"
	gardencorev1beta1 "github.com/gardener/gardener/pkg/apis/core/v1beta1"
	v1beta1constants "github.com/gardener/gardener/pkg/apis/core/v1beta1/constants"
	extensionsv1alpha1 "github.com/gardener/gardener/pkg/apis/extensions/v1alpha1"
	"github.com/gardener/gardener/pkg/component/extensions/operatingsystemconfig"
	"github.com/gardener/gardener/pkg/component/extensions/operatingsystemconfig/original/components/nodeagent"
	gardenletfeatures "github.com/gardener/gardener/pkg/gardenlet/features"
	imagevectorutils "github.com/gardener/gardener/pkg/utils/imagevector"
	fakesecretsmanager "github.com/gardener/gardener/pkg/utils/secrets/manager/fake"
)

const (
	namespace = "shoot--testproj--testshoot"
	poolName  = "worker"
	// A stand-in certificate: Gardener copies the bundle verbatim; --ca-file gives a real one.
	testCABundle = "-----BEGIN CERTIFICATE-----\nTUlJQnRlc3RidW5kbGU=\n-----END CERTIFICATE-----\n"
)

// shape is one worker pool as a shoot would declare it.
type shape struct {
	kubernetes string
	maxPods    int32
	inPlace    bool
	mirrors    bool
	serial     bool
	// set by flags on any shape: the machine image's version, the kubelet data volume's size,
	// the machines' architecture
	imageVersion    string
	kubeletDataSize string
	architecture    string
}

var shapes = map[string]shape{
	"k8s-1.33":       {kubernetes: "1.33.0"},
	"k8s-1.33-patch": {kubernetes: "1.33.1"},
	"k8s-1.34":       {kubernetes: "1.34.0"},
	"k8s-1.34-patch": {kubernetes: "1.34.2"},
	"mirrors":        {kubernetes: "1.33.0", mirrors: true},
	"kubelet-config": {kubernetes: "1.33.0", maxPods: 150},
	"inplace":        {kubernetes: "1.33.0", inPlace: true},
	"serial":         {kubernetes: "1.33.0", serial: true},
}

// File is one file as the node receives it: content decoded, or the image it comes from.
type File struct {
	Path        string `json:"path"`
	Permissions *int64 `json:"permissions,omitempty"`
	Content     string `json:"content,omitempty"`
	Image       string `json:"image,omitempty"`
}

// Output is the generator's JSON document.
type Output struct {
	Shape           string                                    `json:"shape"`
	GardenerVersion string                                    `json:"gardenerVersion"`
	MachineName     string                                    `json:"machineName"`
	Secret          map[string]any                            `json:"secret"`
	ConfigPath      string                                    `json:"configPath"`
	Config          string                                    `json:"config"`
	InitScript      string                                    `json:"initScript"`
	ProvisionFiles  []File                                    `json:"provisionFiles"`
	ProvisionUnits  []extensionsv1alpha1.Unit                 `json:"provisionUnits"`
	ReconcileOSC    *extensionsv1alpha1.OperatingSystemConfig `json:"reconcileOSC"`
	// UserData is the provision OSC as a machine's user data: rendered the way Gardener's own
	// OS extension of provider-local renders it (pkg/provider-local/controller/
	// operatingsystemconfig), from the extensions library's script builders, with
	// machine-controller-manager's placeholders filled in.
	UserData string `json:"userData"`
}

func main() {
	var (
		shapeName   = flag.String("shape", "k8s-1.33", "pool shape: "+strings.Join(shapeNames(), ", "))
		machineName = flag.String("machine-name", "", "machine name (default: one as long as machine-controller-manager makes them)")
		apiServer   = flag.String("api-server", "https://api.testshoot.testproj.example:443", "kube-apiserver URL the node talks to")
		caFile      = flag.String("ca-file", "", "PEM bundle of the cluster CA (default: a stand-in)")
		token       = flag.String("bootstrap-token", "abcdef.0123456789abcdef", "bootstrap token written to the provision files")
		list        = flag.Bool("list", false, "print the shape names and exit")
		inPlace     = flag.Bool("in-place", false, "the pool updates in place (AutoInPlaceUpdate), whatever the shape")
		imageVer    = flag.String("image-version", "1877.5.0", "the machine image's version (an in-place pool's OS version)")
		dataVolume  = flag.String("kubelet-data-volume", "", "the size of a data volume for the kubelet (e.g. 1Gi; default: none)")
		arch        = flag.String("architecture", v1beta1constants.ArchitectureAMD64, "the pool's machine architecture (amd64 or arm64)")
	)
	flag.Parse()
	// gardenlet's feature gates at their defaults: the components consult them.
	gardenletfeatures.RegisterFeatureGates()
	if *list {
		fmt.Println(strings.Join(shapeNames(), "\n"))
		return
	}
	s, ok := shapes[*shapeName]
	if !ok {
		fail(fmt.Errorf("unknown shape %q (known: %s)", *shapeName, strings.Join(shapeNames(), ", ")))
	}
	s.inPlace = s.inPlace || *inPlace
	s.imageVersion, s.kubeletDataSize = *imageVer, *dataVolume
	switch *arch {
	case v1beta1constants.ArchitectureAMD64, v1beta1constants.ArchitectureARM64:
		s.architecture = *arch
	default:
		fail(fmt.Errorf("unknown architecture %q (amd64 or arm64)", *arch))
	}
	if *machineName == "" {
		*machineName = fmt.Sprintf("%s-%s-z1-7d9f8b6c5-q4x2z", namespace, poolName)
	}
	caBundle := []byte(testCABundle)
	if *caFile != "" {
		data, err := os.ReadFile(*caFile)
		if err != nil {
			fail(err)
		}
		caBundle = data
	}
	out, err := render(*shapeName, s, *machineName, *apiServer, caBundle, *token)
	if err != nil {
		fail(err)
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fail(err)
	}
}

func shapeNames() []string {
	names := make([]string, 0, len(shapes))
	for n := range shapes {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "gardener-gen:", err)
	os.Exit(1)
}

func worker(s shape) gardencorev1beta1.Worker {
	w := gardencorev1beta1.Worker{
		Name:    poolName,
		Minimum: 1,
		Maximum: 3,
		Machine: gardencorev1beta1.Machine{
			Type:  "m5.large",
			Image: &gardencorev1beta1.ShootMachineImage{Name: "gardenlinux", Version: new(s.imageVersion)},
			// As the Shoot's defaulting sets it: releases before v1.149 read it without a default.
			Architecture: new(s.architecture),
		},
		CRI:    &gardencorev1beta1.CRI{Name: gardencorev1beta1.CRINameContainerD},
		Volume: &gardencorev1beta1.Volume{VolumeSize: "50Gi", Type: new("gp3")},
		Zones:  []string{"z1"},
	}
	if s.maxPods != 0 {
		w.Kubernetes = &gardencorev1beta1.WorkerKubernetes{Kubelet: &gardencorev1beta1.KubeletConfig{MaxPods: new(s.maxPods)}}
	}
	if s.inPlace {
		w.UpdateStrategy = new(gardencorev1beta1.AutoInPlaceUpdate)
	}
	if s.kubeletDataSize != "" {
		w.DataVolumes = []gardencorev1beta1.DataVolume{{Name: "kubelet", VolumeSize: s.kubeletDataSize, Type: new("gp3")}}
		w.KubeletDataVolumeName = new("kubelet")
	}
	return w
}

func render(name string, s shape, machineName, apiServer string, caBundle []byte, token string) (*Output, error) {
	ctx := context.Background()
	k8sVersion, err := semver.NewVersion(s.kubernetes)
	if err != nil {
		return nil, err
	}

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := extensionsv1alpha1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c := fakeclient.NewClientBuilder().WithScheme(scheme).WithStatusSubresource(&extensionsv1alpha1.OperatingSystemConfig{}).Build()
	for _, ca := range []string{v1beta1constants.SecretNameCACluster, v1beta1constants.SecretNameCAKubelet} {
		secret := &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: ca, Namespace: namespace},
			Data:       map[string][]byte{"bundle.crt": caBundle},
		}
		if err := c.Create(ctx, secret); err != nil {
			return nil, err
		}
	}

	// The images as gardenlet looks them up (pkg/gardenlet/operation/botanist/operatingsystemconfig.go).
	images, err := imagevectorutils.FindImages(imagevector.Containers(),
		[]string{imagevector.ContainerImageNamePauseContainer, imagevector.ContainerImageNameValitail, imagevector.ContainerImageNameOpentelemetryCollector},
		imagevectorutils.RuntimeVersion(k8sVersion.String()), imagevectorutils.TargetVersion(k8sVersion.String()))
	if err != nil {
		return nil, err
	}
	images[imagevector.ContainerImageNameGardenerNodeAgent], err = imagevector.Containers().FindImage(imagevector.ContainerImageNameGardenerNodeAgent)
	if err != nil {
		return nil, err
	}
	images[imagevector.ContainerImageNameGardenerNodeAgent].WithOptionalTag(version.Get().GitVersion)

	w := worker(s)
	values := &operatingsystemconfig.Values{
		Namespace:         namespace,
		KubernetesVersion: k8sVersion,
		Workers:           []gardencorev1beta1.Worker{w},
		InitValues:        operatingsystemconfig.InitValues{APIServerURL: apiServer},
		OriginalValues: operatingsystemconfig.OriginalValues{
			CABundle:               string(caBundle),
			ClusterDNSAddresses:    []string{"100.64.0.10"},
			ClusterDomain:          gardencorev1beta1.DefaultDomain,
			Images:                 images,
			KubeletConfig:          &gardencorev1beta1.KubeletConfig{},
			KubeProxyEnabled:       true,
			SSHAccessEnabled:       true,
			SSHPublicKeys:          []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITestKeyOnly test@example"},
			NodeMonitorGracePeriod: metav1.Duration{Duration: 40 * time.Second},
			PrimaryIPFamily:        gardencorev1beta1.IPFamilyIPv4,
		},
	}
	component := operatingsystemconfig.New(logr.Discard(), c, fakesecretsmanager.New(c, namespace), values, time.Second, time.Second, time.Second)
	if err := component.Deploy(ctx); err != nil {
		return nil, fmt.Errorf("deploying the OperatingSystemConfigs: %w", err)
	}
	oscs := component.WorkerPoolNameToOperatingSystemConfigsMap()[poolName]

	// The reconcile OSC as the OS extension leaves it: its own containerd drop-in in the status,
	// mirrors added by a registry extension, the OS update command of an in-place pool.
	reconcile := oscs.Original.Object.DeepCopy()
	if s.mirrors && reconcile.Spec.CRIConfig != nil && reconcile.Spec.CRIConfig.Containerd != nil {
		reconcile.Spec.CRIConfig.Containerd.Registries = []extensionsv1alpha1.RegistryConfig{{
			Upstream:       "docker.io",
			Server:         new("https://registry-1.docker.io"),
			Hosts:          []extensionsv1alpha1.RegistryHost{{URL: "http://10.4.0.2:5000", Capabilities: []extensionsv1alpha1.RegistryCapability{extensionsv1alpha1.PullCapability, extensionsv1alpha1.ResolveCapability}}},
			ReadinessProbe: new(false),
		}}
	}
	if err := c.Update(ctx, reconcile); err != nil {
		return nil, fmt.Errorf("writing the extension's spec changes: %w", err)
	}
	reconcile.Status.ExtensionUnits = []extensionsv1alpha1.Unit{{
		Name: "containerd.service",
		DropIns: []extensionsv1alpha1.DropIn{{
			Name:    "override.conf",
			Content: "[Service]\nLimitMEMLOCK=67108864\nLimitNOFILE=1048576\n",
		}},
	}}
	if s.inPlace {
		reconcile.Status.InPlaceUpdates = &extensionsv1alpha1.InPlaceUpdatesStatus{
			OSUpdate: &extensionsv1alpha1.OSUpdate{Command: "/opt/gardener/bin/inplace-update.sh", Args: []string{"--version", s.imageVersion}},
		}
	}
	if err := c.Status().Update(ctx, reconcile); err != nil {
		return nil, fmt.Errorf("writing the extension's status: %w", err)
	}
	if err := c.Get(ctx, client.ObjectKeyFromObject(reconcile), reconcile); err != nil {
		return nil, err
	}
	secret, err := nodeagent.OperatingSystemConfigSecret(ctx, c, reconcile, oscs.Original.GardenerNodeAgentSecretName, poolName, true)
	if err != nil {
		return nil, err
	}
	if s.serial {
		metav1.SetMetaDataAnnotation(&secret.ObjectMeta, v1beta1constants.AnnotationNodeAgentSerialOSCReconciliation, "true")
	}

	out := &Output{
		Shape:           name,
		GardenerVersion: version.Get().GitVersion,
		MachineName:     machineName,
		Secret: map[string]any{
			"name":        secret.Name,
			"namespace":   secret.Namespace,
			"labels":      secret.Labels,
			"annotations": secret.Annotations,
			"data":        stringData(secret.Data),
		},
		ReconcileOSC:   reconcile,
		ProvisionUnits: oscs.Init.Object.Spec.Units,
	}

	// The provision files as cloud-init writes them, with machine-controller-manager's
	// placeholders filled in.
	replacer := strings.NewReplacer(
		machinecontroller.MachineNamePlaceholder, machineName,
		machinecontroller.BootstrapTokenPlaceholder, token,
	)
	userData, err := provisionUserData(ctx, c, oscs.Init.Object)
	if err != nil {
		return nil, err
	}
	out.UserData = replacer.Replace(userData)
	for _, f := range oscs.Init.Object.Spec.Files {
		file := File{Path: f.Path}
		if f.Permissions != nil {
			file.Permissions = new(int64(*f.Permissions))
		}
		switch {
		case f.Content.Inline != nil:
			data := []byte(f.Content.Inline.Data)
			if f.Content.Inline.Encoding == "b64" || f.Content.Inline.Encoding == "base64" {
				if data, err = base64.StdEncoding.DecodeString(f.Content.Inline.Data); err != nil {
					return nil, fmt.Errorf("file %s: %w", f.Path, err)
				}
			}
			file.Content = replacer.Replace(string(data))
		case f.Content.ImageRef != nil:
			file.Image = f.Content.ImageRef.Image
		default:
			return nil, fmt.Errorf("provision file %s has neither inline content nor an image", f.Path)
		}
		out.ProvisionFiles = append(out.ProvisionFiles, file)
		switch {
		case strings.HasSuffix(f.Path, "/init.sh"):
			out.InitScript = file.Content
		case strings.Contains(f.Path, "/config-") && strings.HasSuffix(f.Path, ".yaml"):
			out.ConfigPath, out.Config = f.Path, file.Content
		}
	}
	if out.InitScript == "" || out.Config == "" {
		return nil, fmt.Errorf("the provision OSC has no init.sh or no agent config")
	}
	return out, nil
}

// provisionUserData renders the provision OSC as provider-local's OS extension does: a bash
// script that writes the files and units, reloads systemd, enables and (without blocking)
// restarts every unit, wrapped so that it runs once.
func provisionUserData(ctx context.Context, c client.Reader, osc *extensionsv1alpha1.OperatingSystemConfig) (string, error) {
	files, err := osccontroller.FilesToDiskScript(ctx, c, osc.Namespace, osc.Spec.Files)
	if err != nil {
		return "", fmt.Errorf("the provision OSC's files: %w", err)
	}
	var script strings.Builder
	script.WriteString("#!/bin/bash\n" + files + "\n" + osccontroller.UnitsToDiskScript(osc.Spec.Units) + "\nsystemctl daemon-reload\n")
	for _, unit := range osc.Spec.Units {
		fmt.Fprintf(&script, "systemctl enable '%s' && systemctl restart --no-block '%s'\n", unit.Name, unit.Name)
	}
	return osccontroller.WrapProvisionOSCIntoOneshotScript(script.String()), nil
}

func stringData(data map[string][]byte) map[string]string {
	out := make(map[string]string, len(data))
	for k, v := range data {
		out[k] = string(v)
	}
	return out
}
