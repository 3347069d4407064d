package k8s_test

import (
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/api/krusty"
	kustypes "sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
)

// The rules below are those of docs/deploy.md ("What the manifests
// promise"); each failure names the object and the rule it breaks.

const (
	// root is where the test's in-memory copy of this directory lives.
	root = "/k8s"
	// staging is the overlay the test renders.
	staging = "overlays/staging"
	// simFleet is the optional component of simulated machines.
	simFleet = "components/sim-fleet"
	// pkiDir is where each service mounts its PKI Secret, its
	// BETTER_COMPUTE_PKI_DIR.
	pkiDir = "/var/lib/better-compute/pki"
	// nameLabel names the service a workload, Secret or policy is of.
	nameLabel = "app.kubernetes.io/name"
	// secretLabel says what a Secret holds: pki, database or fleet.
	secretLabel = "better-compute.io/secret"
	// migrate is the migration Job's name.
	migrate = "migrate"
	// fakedaemon is the sim-fleet component's workload.
	fakedaemon = "fakedaemon"
	// monitoringNamespace is the only namespace admitted to the probes and
	// metrics listeners.
	monitoringNamespace = "monitoring"
)

// fleetPorts are the only ports machines may reach, per service: the
// well-known document, Join and the sessions (compose.yaml's fleet network).
var fleetPorts = map[string]int32{"api": 8080, "joinservice": 8081, "gateway": 8443}

// TestStaging renders overlays/staging and checks every rule of the
// manifests on what it renders.
func TestStaging(t *testing.T) {
	t.Parallel()
	objs := render(t, false)
	checkAll(t, objs, false)
}

// TestStagingWithSimFleet renders overlays/staging with the sim-fleet
// component added, as docs/deploy.md says to, and checks the same rules and
// the fleet's own.
func TestStagingWithSimFleet(t *testing.T) {
	t.Parallel()
	objs := render(t, true)
	checkAll(t, objs, true)
	if objs.workload(fakedaemon) == nil {
		t.Fatalf("the sim-fleet component renders no workload %s", fakedaemon)
	}
}

func checkAll(t *testing.T, objs *objects, sim bool) {
	t.Run("containers", func(t *testing.T) { checkContainers(t, objs) })
	t.Run("services", func(t *testing.T) { checkServices(t, objs) })
	t.Run("secrets", func(t *testing.T) { checkSecrets(t, objs) })
	t.Run("disruption budgets", func(t *testing.T) { checkPDBs(t, objs) })
	t.Run("network policies", func(t *testing.T) { checkNetworkPolicies(t, objs, sim) })
	t.Run("settings", func(t *testing.T) { checkSettings(t, objs) })
	t.Run("staging", func(t *testing.T) { checkStaging(t, objs) })
}

// objects are the rendered objects, decoded into their k8s.io/api types.
type objects struct {
	deployments  []*appsv1.Deployment
	statefulSets []*appsv1.StatefulSet
	jobs         []*batchv1.Job
	services     []*corev1.Service
	secrets      []*corev1.Secret
	configMaps   []*corev1.ConfigMap
	namespaces   []*corev1.Namespace
	pdbs         []*policyv1.PodDisruptionBudget
	policies     []*networkingv1.NetworkPolicy
}

// workload is one Deployment, StatefulSet or Job: its kind, name, replicas
// (1 for a Job) and pod template.
type workload struct {
	kind     string
	name     string
	replicas int32
	pod      *corev1.PodTemplateSpec
}

func (w workload) String() string { return w.kind + " " + w.name }

// longRunning reports whether w is a Deployment or StatefulSet (the ones
// with probes, a PDB and replicas).
func (w workload) longRunning() bool { return w.kind != "Job" }

func (o *objects) workloads() []workload {
	var out []workload
	for _, d := range o.deployments {
		out = append(out, workload{"Deployment", d.Name, replicasOf(d.Spec.Replicas), &d.Spec.Template})
	}
	for _, s := range o.statefulSets {
		out = append(out, workload{"StatefulSet", s.Name, replicasOf(s.Spec.Replicas), &s.Spec.Template})
	}
	for _, j := range o.jobs {
		out = append(out, workload{"Job", j.Name, 1, &j.Spec.Template})
	}
	return out
}

func (o *objects) workload(name string) *workload {
	for _, w := range o.workloads() {
		if w.name == name {
			return &w
		}
	}
	return nil
}

func replicasOf(r *int32) int32 {
	if r == nil {
		return 1
	}
	return *r
}

// render renders overlays/staging (with the sim-fleet component when sim)
// from an in-memory copy of this directory, with throwaway secrets where the
// overlay's generators read the files docs/deploy.md says to write: a PKI
// that pki.Init makes and pki.Export splits per service, and made-up
// passwords. It decodes every object strictly (an unknown field is an
// error) into its k8s.io/api type.
func render(t *testing.T, sim bool) *objects {
	t.Helper()
	mem := filesys.MakeFsInMemory()
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if d.Name() == "secrets" { // an operator's own, never the test's
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".yaml") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return mem.WriteFile(path.Join(root, filepath.ToSlash(p)), b)
	})
	if err != nil {
		t.Fatal(err)
	}
	writeSecrets(t, mem, sim)
	if sim {
		k := path.Join(root, staging, "kustomization.yaml")
		b, err := mem.ReadFile(k)
		if err != nil {
			t.Fatal(err)
		}
		b = append(b, []byte("components:\n  - ../../"+simFleet+"\n")...)
		if err := mem.WriteFile(k, b); err != nil {
			t.Fatal(err)
		}
	}
	resMap, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(mem, path.Join(root, staging))
	if err != nil {
		t.Fatalf("kustomize build %s: %v (a file a secretGenerator lists must be one that `pki export` writes: "+
			"pkg/pki Layout)", staging, err)
	}
	objs := &objects{}
	for _, r := range resMap.Resources() {
		b, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		id := r.GetKind() + " " + r.GetName()
		if err := objs.decode(r.GetApiVersion(), r.GetKind(), b); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return objs
}

// decode decodes one object strictly into the type of its kind.
func (o *objects) decode(apiVersion, kind string, b []byte) error {
	strict := func(want string, into any) error {
		if apiVersion != want {
			return fmt.Errorf("apiVersion %s, want %s", apiVersion, want)
		}
		// UnmarshalStrict: an unknown or duplicate field is an error.
		return yaml.UnmarshalStrict(b, into)
	}
	var err error
	switch kind {
	case "Deployment":
		v := &appsv1.Deployment{}
		err = strict("apps/v1", v)
		o.deployments = append(o.deployments, v)
	case "StatefulSet":
		v := &appsv1.StatefulSet{}
		err = strict("apps/v1", v)
		o.statefulSets = append(o.statefulSets, v)
	case "Job":
		v := &batchv1.Job{}
		err = strict("batch/v1", v)
		o.jobs = append(o.jobs, v)
	case "Service":
		v := &corev1.Service{}
		err = strict("v1", v)
		o.services = append(o.services, v)
	case "Secret":
		v := &corev1.Secret{}
		err = strict("v1", v)
		o.secrets = append(o.secrets, v)
	case "ConfigMap":
		v := &corev1.ConfigMap{}
		err = strict("v1", v)
		o.configMaps = append(o.configMaps, v)
	case "Namespace":
		v := &corev1.Namespace{}
		err = strict("v1", v)
		o.namespaces = append(o.namespaces, v)
	case "PodDisruptionBudget":
		v := &policyv1.PodDisruptionBudget{}
		err = strict("policy/v1", v)
		o.pdbs = append(o.pdbs, v)
	case "NetworkPolicy":
		v := &networkingv1.NetworkPolicy{}
		err = strict("networking.k8s.io/v1", v)
		o.policies = append(o.policies, v)
	default:
		err = fmt.Errorf("kind %s is none this test checks: add it to objects.decode and its rules", kind)
	}
	return err
}

// writeSecrets writes the throwaway files the overlay's (and, when sim, the
// sim-fleet component's) secretGenerators read.
func writeSecrets(t *testing.T, mem filesys.FileSystem, sim bool) {
	t.Helper()
	tmp := t.TempDir()
	if _, err := pki.Init(filepath.Join(tmp, "pki"), pki.InitOptions{}, clock.New().Now()); err != nil {
		t.Fatal(err)
	}
	write := func(p string, b []byte) {
		t.Helper()
		if err := mem.WriteFile(path.Join(root, p), b); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range pki.Services() {
		out := filepath.Join(tmp, "export", s)
		if _, err := pki.Export(filepath.Join(tmp, "pki"), s, out); err != nil {
			t.Fatal(err)
		}
		files, err := pki.Layout(s)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			b, err := os.ReadFile(filepath.Join(out, f))
			if err != nil {
				t.Fatal(err)
			}
			write(path.Join(staging, "secrets/pki", s, f), b)
		}
		write(path.Join(staging, "secrets/database", s), []byte("throwaway-"+s))
	}
	write(path.Join(staging, "secrets/database/migrate-url"), []byte("postgres://bc:throwaway@postgres:5432/bc"))
	if sim {
		pins, err := os.ReadFile(filepath.Join(tmp, "pki", pki.PinsJSON))
		if err != nil {
			t.Fatal(err)
		}
		write(path.Join(simFleet, "secrets/pins.json"), pins)
		write(path.Join(simFleet, "secrets/join-token"), []byte("throwaway-join-token"))
	}
}

// checkContainers: every container has requests and limits and a non-root,
// read-only security context with no privilege escalation, every capability
// dropped and RuntimeDefault seccomp; every long-running one has a liveness
// and a readiness probe on a port it declares (a control-plane service's on
// /healthz and /readyz); no pod gets a service account token.
func checkContainers(t *testing.T, objs *objects) {
	for _, w := range objs.workloads() {
		spec := w.pod.Spec
		podSC := spec.SecurityContext
		if podSC == nil || podSC.RunAsNonRoot == nil || !*podSC.RunAsNonRoot {
			t.Errorf("%s: pod securityContext.runAsNonRoot is not true", w)
		}
		if podSC == nil || podSC.SeccompProfile == nil || podSC.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: pod securityContext.seccompProfile is not RuntimeDefault", w)
		}
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Errorf("%s: automountServiceAccountToken is not false (no service talks to the Kubernetes API)", w)
		}
		if spec.HostNetwork || spec.HostPID || spec.HostIPC {
			t.Errorf("%s: uses a host namespace", w)
		}
		for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
			id := fmt.Sprintf("%s: container %s", w, c.Name)
			checkResources(t, id, c.Resources)
			checkSecurityContext(t, id, c.SecurityContext)
			// Init containers take no probes; a Job's run to completion.
			if !w.longRunning() || slices.ContainsFunc(spec.InitContainers, func(i corev1.Container) bool { return i.Name == c.Name }) {
				continue
			}
			checkProbe(t, id, "livenessProbe", c, c.LivenessProbe, "/healthz", w.name)
			checkProbe(t, id, "readinessProbe", c, c.ReadinessProbe, "/readyz", w.name)
		}
	}
}

func checkResources(t *testing.T, id string, r corev1.ResourceRequirements) {
	t.Helper()
	for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, okReq := r.Requests[name]
		lim, okLim := r.Limits[name]
		switch {
		case !okReq:
			t.Errorf("%s: no resources.requests.%s", id, name)
		case !okLim:
			t.Errorf("%s: no resources.limits.%s", id, name)
		case req.Cmp(lim) > 0:
			t.Errorf("%s: resources.requests.%s %s is above its limit %s", id, name, req.String(), lim.String())
		case req.Cmp(resource.Quantity{}) <= 0:
			t.Errorf("%s: resources.requests.%s is not positive", id, name)
		}
	}
}

func checkSecurityContext(t *testing.T, id string, sc *corev1.SecurityContext) {
	t.Helper()
	if sc == nil {
		t.Errorf("%s: no securityContext", id)
		return
	}
	if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Errorf("%s: securityContext.runAsNonRoot is not true", id)
	}
	if sc.RunAsUser != nil && *sc.RunAsUser == 0 {
		t.Errorf("%s: securityContext.runAsUser is 0 (root)", id)
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Errorf("%s: securityContext.readOnlyRootFilesystem is not true", id)
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("%s: securityContext.allowPrivilegeEscalation is not false", id)
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Errorf("%s: securityContext.privileged is true", id)
	}
	if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
		t.Errorf("%s: securityContext.capabilities.drop does not hold ALL", id)
	} else if len(sc.Capabilities.Add) > 0 {
		t.Errorf("%s: securityContext.capabilities.add %v: none may be added", id, sc.Capabilities.Add)
	}
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: securityContext.seccompProfile is not RuntimeDefault", id)
	}
}

// checkProbe: the probe exists and reaches a port the container declares;
// a control-plane service's is an HTTP GET of wantPath (its admin
// listener's /healthz or /readyz).
func checkProbe(t *testing.T, id, field string, c corev1.Container, p *corev1.Probe, wantPath, service string) {
	t.Helper()
	if p == nil {
		t.Errorf("%s: no %s", id, field)
		return
	}
	var port intstr.IntOrString
	switch {
	case p.HTTPGet != nil:
		port = p.HTTPGet.Port
		if slices.Contains(pki.Services(), service) && p.HTTPGet.Path != wantPath {
			t.Errorf("%s: %s GETs %q, want %q", id, field, p.HTTPGet.Path, wantPath)
		}
	case p.TCPSocket != nil && !slices.Contains(pki.Services(), service):
		port = p.TCPSocket.Port
	default:
		t.Errorf("%s: %s is not an HTTP GET of %s", id, field, wantPath)
		return
	}
	if containerPort(c, port) == nil {
		t.Errorf("%s: %s port %s is none of the container's ports", id, field, port.String())
	}
}

// containerPort is c's port that p names (by name or number), or nil.
func containerPort(c corev1.Container, p intstr.IntOrString) *corev1.ContainerPort {
	for i, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return &c.Ports[i]
		}
	}
	return nil
}

// selects reports whether sel (a label selector) selects the pods of w.
func selects(t *testing.T, sel *metav1.LabelSelector, w workload) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatalf("selector %v: %v", sel, err)
	}
	return !s.Empty() && s.Matches(labels.Set(w.pod.Labels))
}

// selected are the long-running workloads whose pods sel selects (an empty
// selector selects all of them).
func selected(t *testing.T, objs *objects, sel metav1.LabelSelector) []workload {
	t.Helper()
	var out []workload
	for _, w := range objs.workloads() {
		if !w.longRunning() {
			continue
		}
		if (len(sel.MatchLabels) == 0 && len(sel.MatchExpressions) == 0) || selects(t, &sel, w) {
			out = append(out, w)
		}
	}
	return out
}

// checkServices: every Service selects the pods of some Deployment or
// StatefulSet, and each of its ports' targets is a port of every container
// group it selects.
func checkServices(t *testing.T, objs *objects) {
	for _, s := range objs.services {
		id := "Service " + s.Name
		if len(s.Spec.Selector) == 0 {
			t.Errorf("%s: no selector", id)
			continue
		}
		ws := selected(t, objs, metav1.LabelSelector{MatchLabels: s.Spec.Selector})
		if len(ws) == 0 {
			t.Errorf("%s: selector %v selects no Deployment's or StatefulSet's pods", id, s.Spec.Selector)
			continue
		}
		for _, w := range ws {
			for _, sp := range s.Spec.Ports {
				target := sp.TargetPort
				if target.Type == intstr.Int && target.IntVal == 0 {
					target = intstr.FromInt32(sp.Port)
				}
				found := false
				for _, c := range w.pod.Spec.Containers {
					if cp := containerPort(c, target); cp != nil && cp.Protocol == protocolOr(sp.Protocol) {
						found = true
					}
				}
				if !found {
					t.Errorf("%s: port %s targets %s, which no container of %s declares", id, sp.Name, target.String(), w)
				}
			}
		}
	}
}

func protocolOr(p corev1.Protocol) corev1.Protocol {
	if p == "" {
		return corev1.ProtocolTCP
	}
	return p
}

// secretRefs maps each Secret name to the workloads that refer to it, by a
// volume (mounted or not), an env or an envFrom.
func secretRefs(objs *objects) map[string][]string {
	refs := map[string][]string{}
	add := func(secret, w string) {
		if !slices.Contains(refs[secret], w) {
			refs[secret] = append(refs[secret], w)
		}
	}
	for _, w := range objs.workloads() {
		spec := w.pod.Spec
		for _, v := range spec.Volumes {
			if v.Secret != nil {
				add(v.Secret.SecretName, w.name)
			}
			if v.Projected != nil {
				for _, src := range v.Projected.Sources {
					if src.Secret != nil {
						add(src.Secret.Name, w.name)
					}
				}
			}
		}
		for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
			for _, e := range c.Env {
				if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
					add(e.ValueFrom.SecretKeyRef.Name, w.name)
				}
			}
			for _, e := range c.EnvFrom {
				if e.SecretRef != nil {
					add(e.SecretRef.Name, w.name)
				}
			}
		}
	}
	return refs
}

// secretKeys are the keys of s, sorted.
func secretKeys(s *corev1.Secret) []string {
	var out []string
	for k := range s.Data {
		out = append(out, k)
	}
	for k := range s.StringData {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// checkSecrets: every Secret is one service's: a pki one holds exactly that
// service's files of pkg/pki Layout and is mounted by that service alone,
// at its BETTER_COMPUTE_PKI_DIR; a database one holds its role's password
// (the migration's: the owner's URL) and is read by that service and the
// migration only; the fleet's holds the join token and the pins and is read
// by the fakedaemons only. Every Secret a workload refers to is rendered,
// and every control-plane service mounts its pki Secret.
func checkSecrets(t *testing.T, objs *objects) {
	refs := secretRefs(objs)
	byName := map[string]*corev1.Secret{}
	for _, s := range objs.secrets {
		byName[s.Name] = s
	}
	for name, ws := range refs {
		if byName[name] == nil {
			t.Errorf("Secret %s: referred to by %v but not rendered (add a secretGenerator)", name, ws)
		}
	}
	pkiSecretOf := map[string]string{}
	for _, s := range objs.secrets {
		id := "Secret " + s.Name
		owner := s.Labels[nameLabel]
		users := refs[s.Name]
		sort.Strings(users)
		switch kind := s.Labels[secretLabel]; kind {
		case "pki":
			want, err := pki.Layout(owner)
			if err != nil {
				t.Errorf("%s: label %s=%q: %v", id, nameLabel, owner, err)
				continue
			}
			if diff := cmp.Diff(want, secretKeys(s)); diff != "" {
				t.Errorf("%s: keys are not exactly pki.Layout(%s) (-Layout +Secret; keep the secretGenerator of %s in step):\n%s",
					id, owner, staging, diff)
			}
			if !slices.Equal(users, []string{owner}) {
				t.Errorf("%s: mounted by %v, want by %s alone", id, users, owner)
			}
			pkiSecretOf[owner] = s.Name
		case "database":
			var want, wantUsers []string
			if owner == migrate {
				want, wantUsers = []string{"url"}, []string{migrate}
			} else {
				if !slices.Contains(pki.Services(), owner) {
					t.Errorf("%s: label %s=%q is no control-plane service", id, nameLabel, owner)
				}
				want, wantUsers = []string{"password"}, []string{owner, migrate}
				sort.Strings(wantUsers)
			}
			if diff := cmp.Diff(want, secretKeys(s)); diff != "" {
				t.Errorf("%s: keys (-want +got):\n%s", id, diff)
			}
			if !slices.Equal(users, wantUsers) {
				t.Errorf("%s: read by %v, want by %v only", id, users, wantUsers)
			}
		case "fleet":
			if diff := cmp.Diff([]string{"join-token", pki.PinsJSON}, secretKeys(s)); diff != "" {
				t.Errorf("%s: keys (-want +got):\n%s", id, diff)
			}
			if !slices.Equal(users, []string{fakedaemon}) {
				t.Errorf("%s: read by %v, want by %s only", id, users, fakedaemon)
			}
		default:
			t.Errorf("%s: label %s=%q is none of pki, database, fleet", id, secretLabel, kind)
		}
		for k := range s.Data {
			if pki.IsPrivateKey(k) && s.Labels[secretLabel] != "pki" {
				t.Errorf("%s: holds the private key %s outside a pki Secret", id, k)
			}
		}
	}
	for _, svc := range pki.Services() {
		w := objs.workload(svc)
		if w == nil || w.kind != "Deployment" {
			t.Errorf("service %s: no Deployment named %s", svc, svc)
			continue
		}
		secret := pkiSecretOf[svc]
		if secret == "" {
			t.Errorf("%s: no Secret labelled %s=pki, %s=%s", w, secretLabel, nameLabel, svc)
			continue
		}
		checkPKIMount(t, *w, secret)
	}
}

// checkPKIMount: w's containers mount secret read-only at pkiDir, which
// their BETTER_COMPUTE_PKI_DIR names.
func checkPKIMount(t *testing.T, w workload, secret string) {
	t.Helper()
	var volume string
	for _, v := range w.pod.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == secret {
			volume = v.Name
			if v.Secret.DefaultMode != nil && *v.Secret.DefaultMode&0o007 != 0 {
				t.Errorf("%s: volume %s: defaultMode %#o lets others read the keys", w, v.Name, *v.Secret.DefaultMode)
			}
		}
	}
	for _, c := range w.pod.Spec.Containers {
		mounted := false
		for _, m := range c.VolumeMounts {
			if m.Name == volume && m.MountPath == pkiDir && m.ReadOnly {
				mounted = true
			}
		}
		if !mounted {
			t.Errorf("%s: container %s does not mount Secret %s read-only at %s", w, c.Name, secret, pkiDir)
		}
		env := ""
		for _, e := range c.Env {
			if e.Name == "BETTER_COMPUTE_PKI_DIR" {
				env = e.Value
			}
		}
		if env != pkiDir {
			t.Errorf("%s: container %s: BETTER_COMPUTE_PKI_DIR is %q, want %s", w, c.Name, env, pkiDir)
		}
	}
}

// checkPDBs: every Deployment and StatefulSet has a PodDisruptionBudget that
// selects its pods and lets one of two replicas go.
func checkPDBs(t *testing.T, objs *objects) {
	for _, w := range objs.workloads() {
		if !w.longRunning() {
			continue
		}
		var found []string
		for _, p := range objs.pdbs {
			if p.Spec.Selector == nil || !selects(t, p.Spec.Selector, w) {
				continue
			}
			found = append(found, p.Name)
			switch {
			case p.Spec.MaxUnavailable != nil:
				if v, err := intstr.GetScaledValueFromIntOrPercent(p.Spec.MaxUnavailable, int(w.replicas), true); err != nil || v < 1 {
					t.Errorf("PodDisruptionBudget %s: maxUnavailable %s lets no pod of %s go", p.Name, p.Spec.MaxUnavailable.String(), w)
				}
			case p.Spec.MinAvailable != nil:
				if v, err := intstr.GetScaledValueFromIntOrPercent(p.Spec.MinAvailable, int(w.replicas), true); err != nil || v >= int(w.replicas) {
					t.Errorf("PodDisruptionBudget %s: minAvailable %s lets no pod of %s go", p.Name, p.Spec.MinAvailable.String(), w)
				}
			default:
				t.Errorf("PodDisruptionBudget %s: neither minAvailable nor maxUnavailable", p.Name)
			}
		}
		if len(found) != 1 {
			t.Errorf("%s: selected by PodDisruptionBudgets %v, want exactly one", w, found)
		}
	}
}

// checkNetworkPolicies: a default-deny policy covers every pod; every
// workload has a policy of its own; ingress from outside the namespace (no
// `from`, or an ipBlock) reaches only api, joinservice and gateway, on
// their fleet ports; a namespaceSelector admits only the monitoring
// namespace, to probe ports; a podSelector peer selects some workload;
// every rule names its ports. With the sim fleet, the fakedaemons reach
// only DNS and the fleet ports of api, joinservice and gateway.
func checkNetworkPolicies(t *testing.T, objs *objects, sim bool) {
	defaultDeny := false
	for _, p := range objs.policies {
		if len(p.Spec.PodSelector.MatchLabels) == 0 && len(p.Spec.PodSelector.MatchExpressions) == 0 {
			types := slices.Clone(p.Spec.PolicyTypes)
			slices.Sort(types)
			if len(p.Spec.Ingress) == 0 && len(p.Spec.Egress) == 0 &&
				slices.Equal(types, []networkingv1.PolicyType{networkingv1.PolicyTypeEgress, networkingv1.PolicyTypeIngress}) {
				defaultDeny = true
				continue
			}
			t.Errorf("NetworkPolicy %s: selects every pod but is not a default deny (policyTypes Ingress and Egress, no rules)", p.Name)
		}
	}
	if !defaultDeny {
		t.Errorf("no default-deny NetworkPolicy (podSelector {}, policyTypes Ingress and Egress, no rules)")
	}
	for _, w := range objs.workloads() {
		var own []string
		for _, p := range objs.policies {
			if selects(t, &p.Spec.PodSelector, w) {
				own = append(own, p.Name)
			}
		}
		if len(own) == 0 {
			t.Errorf("%s: no NetworkPolicy selects its pods", w)
		}
	}
	admitted := map[string]bool{}
	for _, p := range objs.policies {
		targets := selected(t, objs, p.Spec.PodSelector)
		if len(p.Spec.PodSelector.MatchLabels) == 0 && len(p.Spec.PodSelector.MatchExpressions) == 0 {
			continue // the default deny
		}
		for i, r := range p.Spec.Ingress {
			id := fmt.Sprintf("NetworkPolicy %s: ingress rule %d", p.Name, i)
			if len(r.Ports) == 0 {
				t.Errorf("%s: admits every port (name them)", id)
			}
			fromOutside := len(r.From) == 0
			for _, peer := range r.From {
				switch {
				case peer.IPBlock != nil:
					fromOutside = true
				case peer.NamespaceSelector != nil:
					if peer.PodSelector != nil || peer.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != monitoringNamespace {
						t.Errorf("%s: a namespaceSelector other than the %s namespace's", id, monitoringNamespace)
					}
					for _, w := range targets {
						for _, port := range r.Ports {
							if !isProbePort(w, port) {
								t.Errorf("%s: admits the %s namespace to %s port %s, which is not its probes'", id, monitoringNamespace, w, portString(port))
							}
						}
					}
				case peer.PodSelector != nil:
					if len(selected(t, objs, *peer.PodSelector)) == 0 {
						t.Errorf("%s: podSelector %v selects no workload's pods", id, peer.PodSelector.MatchLabels)
					}
				}
			}
			if !fromOutside {
				continue
			}
			for _, w := range targets {
				want, ok := fleetPorts[w.name]
				if !ok {
					t.Errorf("%s: admits the fleet (any source) to %s: only %v are fleet-facing", id, w, sortedKeys(fleetPorts))
					continue
				}
				for _, port := range r.Ports {
					if port.Port == nil || resolvePort(w, *port.Port) != want {
						t.Errorf("%s: admits the fleet to %s port %s, want only %d", id, w, portString(port), want)
					}
				}
				admitted[w.name] = true
			}
		}
	}
	for name := range fleetPorts {
		if !admitted[name] {
			t.Errorf("%s: no ingress rule admits the fleet to port %d", name, fleetPorts[name])
		}
	}
	if sim {
		checkFleetEgress(t, objs)
	}
}

// checkFleetEgress: the fakedaemons' egress reaches only DNS and the fleet
// ports of api, joinservice and gateway, as compose's fleet network does.
func checkFleetEgress(t *testing.T, objs *objects) {
	w := objs.workload(fakedaemon)
	if w == nil {
		t.Errorf("no %s workload", fakedaemon)
		return
	}
	for _, p := range objs.policies {
		if len(p.Spec.PodSelector.MatchLabels) == 0 || !selects(t, &p.Spec.PodSelector, *w) {
			continue
		}
		if !slices.Contains(p.Spec.PolicyTypes, networkingv1.PolicyTypeEgress) {
			t.Errorf("NetworkPolicy %s: selects %s but does not restrict its egress", p.Name, w)
		}
		for i, r := range p.Spec.Egress {
			id := fmt.Sprintf("NetworkPolicy %s: egress rule %d", p.Name, i)
			if len(r.To) == 0 {
				t.Errorf("%s: lets %s reach any address", id, w)
			}
			for _, peer := range r.To {
				switch {
				case peer.IPBlock != nil:
					t.Errorf("%s: lets %s reach an ipBlock", id, w)
				case peer.NamespaceSelector != nil:
					if peer.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != "kube-system" ||
						peer.PodSelector == nil || peer.PodSelector.MatchLabels["k8s-app"] != "kube-dns" {
						t.Errorf("%s: lets %s reach another namespace than kube-dns's", id, w)
					}
					for _, port := range r.Ports {
						if port.Port == nil || port.Port.IntValue() != 53 {
							t.Errorf("%s: lets %s reach kube-dns on port %s", id, w, portString(port))
						}
					}
				case peer.PodSelector != nil:
					targets := selected(t, objs, *peer.PodSelector)
					if len(targets) == 0 {
						t.Errorf("%s: podSelector %v selects no workload", id, peer.PodSelector.MatchLabels)
					}
					for _, tw := range targets {
						want, ok := fleetPorts[tw.name]
						if !ok {
							t.Errorf("%s: lets %s reach %s: only %v are fleet-facing", id, w, tw, sortedKeys(fleetPorts))
							continue
						}
						if len(r.Ports) == 0 {
							t.Errorf("%s: lets %s reach every port of %s", id, w, tw)
						}
						for _, port := range r.Ports {
							if port.Port == nil || resolvePort(tw, *port.Port) != want {
								t.Errorf("%s: lets %s reach %s port %s, want only %d", id, w, tw, portString(port), want)
							}
						}
					}
				}
			}
		}
	}
}

// resolvePort is the number of port p of w's containers (a name resolved),
// or 0.
func resolvePort(w workload, p intstr.IntOrString) int32 {
	for _, c := range w.pod.Spec.Containers {
		if cp := containerPort(c, p); cp != nil {
			return cp.ContainerPort
		}
	}
	return 0
}

// isProbePort reports whether port is the port of one of w's probes.
func isProbePort(w workload, port networkingv1.NetworkPolicyPort) bool {
	if port.Port == nil {
		return false
	}
	n := resolvePort(w, *port.Port)
	for _, c := range w.pod.Spec.Containers {
		for _, p := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe, c.StartupProbe} {
			switch {
			case p == nil:
			case p.HTTPGet != nil && resolvePort(w, p.HTTPGet.Port) == n:
				return true
			case p.TCPSocket != nil && resolvePort(w, p.TCPSocket.Port) == n:
				return true
			}
		}
	}
	return false
}

func portString(p networkingv1.NetworkPolicyPort) string {
	if p.Port == nil {
		return "(every port)"
	}
	return p.Port.String()
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// signedIntent are the services that read BETTER_COMPUTE_SIGNED_INTENT
// (docs/configuration.md), which must be set alike for all of them.
var signedIntent = []string{"api", "joinservice", "scheduler", "controllers"}

// checkSettings: each control-plane service connects to PostgreSQL as its
// own role, bc_<service>, with the password of its <service>-database
// Secret (docs/architecture.md, "Keys and roles"), and every service that
// reads signed intent takes it from the one key of the shared ConfigMap;
// the migration gives each role the password of its service's Secret
// (BETTER_COMPUTE_DB_PASSWORD_<SERVICE>, `migrate up --roles`).
func checkSettings(t *testing.T, objs *objects) {
	if m := objs.workload(migrate); m == nil {
		t.Errorf("no migration Job %s", migrate)
	} else {
		for _, svc := range pki.Services() {
			name := "BETTER_COMPUTE_DB_PASSWORD_" + strings.ToUpper(svc)
			ok := false
			for _, c := range m.pod.Spec.Containers {
				for _, e := range c.Env {
					if e.Name == name && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil &&
						e.ValueFrom.SecretKeyRef.Key == "password" && byLabel(objs, e.ValueFrom.SecretKeyRef.Name, "database") == svc {
						ok = true
					}
				}
			}
			if !ok {
				t.Errorf("%s: %s is not the key password of the Secret %s-database", m, name, svc)
			}
		}
	}
	for _, svc := range pki.Services() {
		w := objs.workload(svc)
		if w == nil {
			continue // checkSecrets names it
		}
		for _, c := range w.pod.Spec.Containers {
			id := fmt.Sprintf("%s: container %s", w, c.Name)
			env := map[string]corev1.EnvVar{}
			for _, e := range c.Env {
				env[e.Name] = e
			}
			url := env["BETTER_COMPUTE_DATABASE_URL"].Value
			role, rest, _ := strings.Cut(strings.TrimPrefix(url, "postgres://"), ":")
			pw, _, closed := strings.Cut(strings.TrimPrefix(rest, "$("), ")")
			if role != "bc_"+svc || !strings.HasPrefix(rest, "$(") || !closed {
				t.Errorf("%s: BETTER_COMPUTE_DATABASE_URL %q does not connect as role bc_%s with a password from the environment", id, url, svc)
			} else {
				ref := env[pw].ValueFrom
				if ref == nil || ref.SecretKeyRef == nil || byLabel(objs, ref.SecretKeyRef.Name, "database") != svc {
					t.Errorf("%s: the password %s of BETTER_COMPUTE_DATABASE_URL is not from the Secret %s-database", id, pw, svc)
				}
			}
			e, set := env["BETTER_COMPUTE_SIGNED_INTENT"]
			switch {
			case !slices.Contains(signedIntent, svc):
				if set {
					t.Errorf("%s: sets BETTER_COMPUTE_SIGNED_INTENT, which it does not read", id)
				}
			case !set || e.ValueFrom == nil || e.ValueFrom.ConfigMapKeyRef == nil || e.ValueFrom.ConfigMapKeyRef.Key != "signed-intent":
				t.Errorf("%s: BETTER_COMPUTE_SIGNED_INTENT is not from the shared ConfigMap's key signed-intent (set it alike for %v)", id, signedIntent)
			}
		}
	}
}

// byLabel is the service the Secret name is of (its app.kubernetes.io/name)
// when its kind (better-compute.io/secret) is kind, or "".
func byLabel(objs *objects, name, kind string) string {
	for _, s := range objs.secrets {
		if s.Name == name && s.Labels[secretLabel] == kind {
			return s.Labels[nameLabel]
		}
	}
	return ""
}

// versionTag is the shape of `git describe --tags --always` (a tag, a tag
// with -N-g<hash>, or an abbreviated hash); a -dirty build never deploys.
var versionTag = regexp.MustCompile(`^(v?[0-9]+\.[0-9]+\.[0-9]+([-.][0-9A-Za-z.-]+)?|[0-9a-f]{7,40})$`)

// checkStaging: the namespace enforces the restricted Pod Security
// standard; two replicas of every control-plane service; every image at a
// version tag, set in the overlay one image at a time (so that each service
// rolls out alone).
func checkStaging(t *testing.T, objs *objects) {
	if len(objs.namespaces) != 1 {
		t.Errorf("%s renders %d Namespaces, want 1", staging, len(objs.namespaces))
	}
	for _, ns := range objs.namespaces {
		if got := ns.Labels["pod-security.kubernetes.io/enforce"]; got != "restricted" {
			t.Errorf("Namespace %s: label pod-security.kubernetes.io/enforce is %q, want restricted", ns.Name, got)
		}
	}
	for _, svc := range pki.Services() {
		if w := objs.workload(svc); w != nil && w.replicas != 2 {
			t.Errorf("%s: %d replicas, want 2", w, w.replicas)
		}
	}
	b, err := os.ReadFile(filepath.Join(staging, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustypes.Kustomization
	if err := yaml.UnmarshalStrict(b, &k); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", staging, err)
	}
	tags := map[string]string{}
	for _, img := range k.Images {
		if _, dup := tags[img.Name]; dup {
			t.Errorf("%s/kustomization.yaml: image %s is set twice", staging, img.Name)
		}
		tags[img.Name] = img.NewTag
		if img.Digest == "" && !versionTag.MatchString(img.NewTag) || strings.HasSuffix(img.NewTag, "-dirty") {
			t.Errorf("%s/kustomization.yaml: image %s: newTag %q is not a version from `git describe --tags --always` "+
				"(never dev, latest or -dirty)", staging, img.Name, img.NewTag)
		}
	}
	for _, w := range objs.workloads() {
		for _, c := range slices.Concat(w.pod.Spec.InitContainers, w.pod.Spec.Containers) {
			name, tag := c.Image, ""
			if i := strings.LastIndex(c.Image, ":"); i > strings.LastIndex(c.Image, "/") {
				name, tag = c.Image[:i], c.Image[i+1:]
			}
			if !versionTag.MatchString(tag) || strings.HasSuffix(tag, "-dirty") {
				t.Errorf("%s: container %s: image %q has no version tag", w, c.Name, c.Image)
			}
			base := path.Base(name)
			if _, ok := tags["better-compute/"+base]; !ok {
				t.Errorf("%s: container %s: image %q is not set by its own entry of %s/kustomization.yaml's images",
					w, c.Name, c.Image, staging)
			}
		}
	}
}
