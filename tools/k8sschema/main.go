// Command k8sschema validates Kubernetes manifests offline against the Kubernetes API types.
//
// There is no cluster and no network to fetch JSON schemas from, so the schema is the Go types
// of k8s.io/api themselves: the structs the API server decodes requests into. Each document of
// each multi-document YAML file is
//
//  1. identified by apiVersion/kind; a kind not in the table below is an error (this catches
//     removed API versions such as extensions/v1beta1 DaemonSet as well as typos);
//  2. decoded strictly, the way the API server does with fieldValidation=Strict: duplicate
//     keys, unknown fields (case-sensitive) and wrong value types are errors;
//  3. checked for the required fields and invariants the API server would reject (metadata
//     names, DaemonSet selector matching its template labels, containers with names and images,
//     volume mounts naming declared volumes, probe ports, tolerations, env sources, ...);
//  4. cross-checked against the other objects given together: a Service selects a workload in
//     the set and its named targetPort exists there, and a pod's ConfigMap volumes and
//     ServiceAccount are defined in the set.
//
// Usage: k8sschema [-allow-missing-namespace] FILE|DIR|- ...
// Prints one "ok" line per object on stdout and every problem on stderr; exits 1 when any
// object is invalid, 2 on a usage or read error.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metavalidation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

type kindInfo struct {
	newObj     func() any
	namespaced bool
	nameFn     apivalidation.ValidateNameFunc
}

// The kinds a node agent's deployment uses. Anything else is refused rather than passed
// unchecked; add a kind here (with its checks) when the manifests need one.
var kinds = map[schema.GroupVersionKind]kindInfo{
	{Version: "v1", Kind: "Namespace"}:                                              {func() any { return &corev1.Namespace{} }, false, apivalidation.NameIsDNSLabel},
	{Version: "v1", Kind: "ServiceAccount"}:                                         {func() any { return &corev1.ServiceAccount{} }, true, apivalidation.NameIsDNSSubdomain},
	{Version: "v1", Kind: "ConfigMap"}:                                              {func() any { return &corev1.ConfigMap{} }, true, apivalidation.NameIsDNSSubdomain},
	{Version: "v1", Kind: "Secret"}:                                                 {func() any { return &corev1.Secret{} }, true, apivalidation.NameIsDNSSubdomain},
	{Version: "v1", Kind: "Service"}:                                                {func() any { return &corev1.Service{} }, true, apivalidation.NameIsDNS1035Label},
	{Group: "apps", Version: "v1", Kind: "DaemonSet"}:                               {func() any { return &appsv1.DaemonSet{} }, true, apivalidation.NameIsDNSSubdomain},
	{Group: "networking.k8s.io", Version: "v1", Kind: "NetworkPolicy"}:              {func() any { return &networkingv1.NetworkPolicy{} }, true, apivalidation.NameIsDNSSubdomain},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRole"}:        {func() any { return &rbacv1.ClusterRole{} }, false, pathSegmentName},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "ClusterRoleBinding"}: {func() any { return &rbacv1.ClusterRoleBinding{} }, false, pathSegmentName},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "Role"}:               {func() any { return &rbacv1.Role{} }, true, pathSegmentName},
	{Group: "rbac.authorization.k8s.io", Version: "v1", Kind: "RoleBinding"}:        {func() any { return &rbacv1.RoleBinding{} }, true, pathSegmentName},
}

// RBAC object names only need to be valid URL path segments (the API server's rule).
func pathSegmentName(name string, prefix bool) []string {
	if name == "." || name == ".." || strings.ContainsAny(name, "/%") {
		return []string{"may not be '.', '..' or contain '/' or '%'"}
	}
	return nil
}

// object is one decoded document.
type object struct {
	where string // file#index
	gvk   schema.GroupVersionKind
	obj   any
	meta  *metav1.ObjectMeta
}

func (o *object) id() string {
	name := o.meta.Name
	if o.meta.Namespace != "" {
		name = o.meta.Namespace + "/" + name
	}
	return fmt.Sprintf("%s %s %s", o.gvk.GroupVersion().String(), o.gvk.Kind, name)
}

type report struct {
	errors int
}

func (r *report) fail(where, what string, errs ...string) {
	for _, e := range errs {
		fmt.Fprintf(os.Stderr, "%s %s: %s\n", where, what, e)
		r.errors++
	}
}

func main() {
	allowNoNS := flag.Bool("allow-missing-namespace", false,
		"accept namespaced objects without metadata.namespace (default: they must name it, so "+
			"`kubectl apply` never drops them into the current context's namespace)")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: k8sschema [-allow-missing-namespace] FILE|DIR|- ...\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	files, err := expand(flag.Args())
	if err != nil {
		fmt.Fprintln(os.Stderr, "k8sschema:", err)
		os.Exit(2)
	}
	rep := &report{}
	var objs []*object
	for _, f := range files {
		docs, err := readDocs(f)
		if err != nil {
			fmt.Fprintf(os.Stderr, "k8sschema: %s: %v\n", f, err)
			os.Exit(2)
		}
		for i, doc := range docs {
			o := decode(fmt.Sprintf("%s#%d", f, i), doc, rep)
			if o != nil {
				objs = append(objs, o)
			}
		}
	}
	for _, o := range objs {
		before := rep.errors
		check(o, objs, !*allowNoNS, rep)
		if rep.errors == before {
			fmt.Printf("ok %s %s\n", o.where, o.id())
		}
	}
	fmt.Printf("%d objects, %d errors\n", len(objs), rep.errors)
	if rep.errors > 0 || len(objs) == 0 {
		if len(objs) == 0 {
			fmt.Fprintln(os.Stderr, "k8sschema: no objects found")
		}
		os.Exit(1)
	}
}

// expand turns directories into their *.yaml / *.yml files, sorted.
func expand(args []string) ([]string, error) {
	var out []string
	for _, a := range args {
		if a == "-" {
			out = append(out, a)
			continue
		}
		st, err := os.Stat(a)
		if err != nil {
			return nil, err
		}
		if !st.IsDir() {
			out = append(out, a)
			continue
		}
		var found []string
		for _, pat := range []string{"*.yaml", "*.yml"} {
			m, _ := filepath.Glob(filepath.Join(a, pat))
			found = append(found, m...)
		}
		sort.Strings(found)
		if len(found) == 0 {
			return nil, fmt.Errorf("%s: no *.yaml or *.yml files", a)
		}
		out = append(out, found...)
	}
	return out, nil
}

func readDocs(path string) ([][]byte, error) {
	var r io.Reader
	if path == "-" {
		r = os.Stdin
	} else {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	yr := k8syaml.NewYAMLReader(bufio.NewReader(r))
	var docs [][]byte
	for {
		doc, err := yr.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		docs = append(docs, doc)
	}
}

// decode identifies and strictly decodes one document; nil for an empty (comment-only)
// document or one that failed (the failure is reported).
func decode(where string, doc []byte, rep *report) *object {
	jsonDoc, err := yaml.YAMLToJSONStrict(doc) // duplicate keys are an error here
	if err != nil {
		rep.fail(where, "yaml", err.Error())
		return nil
	}
	if t := bytes.TrimSpace(jsonDoc); len(t) == 0 || string(t) == "null" {
		return nil
	}
	var tm metav1.TypeMeta
	if err := kjson.UnmarshalCaseSensitivePreserveInts(jsonDoc, &tm); err != nil {
		rep.fail(where, "document", "not an object: "+err.Error())
		return nil
	}
	if tm.APIVersion == "" || tm.Kind == "" {
		rep.fail(where, "document", "apiVersion and kind are required")
		return nil
	}
	gvk := schema.FromAPIVersionAndKind(tm.APIVersion, tm.Kind)
	info, ok := kinds[gvk]
	if !ok {
		var known []string
		for k := range kinds {
			known = append(known, k.GroupVersion().String()+" "+k.Kind)
		}
		sort.Strings(known)
		rep.fail(where, tm.APIVersion+" "+tm.Kind,
			"unknown kind (known: "+strings.Join(known, ", ")+")")
		return nil
	}
	obj := info.newObj()
	// The API server's own decoder: case-sensitive field names, strict about unknown and
	// duplicate fields, with all strict errors reported rather than the first.
	strictErrs, err := kjson.UnmarshalStrict(jsonDoc, obj, kjson.DisallowDuplicateFields,
		kjson.DisallowUnknownFields)
	label := tm.APIVersion + " " + tm.Kind
	if err != nil {
		rep.fail(where, label, "decode: "+err.Error())
		return nil
	}
	if len(strictErrs) > 0 {
		msgs := make([]string, len(strictErrs))
		for i, e := range strictErrs {
			msgs[i] = "strict decoding: " + e.Error()
		}
		rep.fail(where, label, msgs...)
		return nil
	}
	meta := reflect.ValueOf(obj).Elem().FieldByName("ObjectMeta").Addr().Interface().(*metav1.ObjectMeta)
	return &object{where: where, gvk: gvk, obj: obj, meta: meta}
}

// ---------------------------------------------------------------------------- checks

func check(o *object, all []*object, requireNS bool, rep *report) {
	info := kinds[o.gvk]
	var errs field.ErrorList
	meta := *o.meta
	if info.namespaced && meta.Namespace == "" && !requireNS {
		meta.Namespace = "default" // validated as if applied to some namespace
	}
	errs = append(errs, apivalidation.ValidateObjectMeta(&meta, info.namespaced, info.nameFn,
		field.NewPath("metadata"))...)
	switch obj := o.obj.(type) {
	case *corev1.ConfigMap:
		errs = append(errs, checkConfigMap(obj)...)
	case *corev1.Secret:
		for k := range obj.Data {
			for _, m := range validation.IsConfigMapKey(k) {
				errs = append(errs, field.Invalid(field.NewPath("data").Key(k), k, m))
			}
		}
	case *corev1.Service:
		errs = append(errs, checkService(o, obj, all)...)
	case *appsv1.DaemonSet:
		errs = append(errs, checkDaemonSet(o, obj, all)...)
	case *networkingv1.NetworkPolicy:
		errs = append(errs, checkNetworkPolicy(o, obj, all)...)
	case *rbacv1.ClusterRole:
		errs = append(errs, checkRules(obj.Rules, field.NewPath("rules"))...)
	case *rbacv1.Role:
		errs = append(errs, checkRules(obj.Rules, field.NewPath("rules"))...)
	case *rbacv1.ClusterRoleBinding:
		errs = append(errs, checkBinding(obj.RoleRef, obj.Subjects, true, "")...)
	case *rbacv1.RoleBinding:
		errs = append(errs, checkBinding(obj.RoleRef, obj.Subjects, false, obj.Namespace)...)
	}
	for _, e := range errs {
		rep.fail(o.where, o.id(), e.Error())
	}
}

func checkConfigMap(cm *corev1.ConfigMap) field.ErrorList {
	var errs field.ErrorList
	for k := range cm.Data {
		for _, m := range validation.IsConfigMapKey(k) {
			errs = append(errs, field.Invalid(field.NewPath("data").Key(k), k, m))
		}
		if _, dup := cm.BinaryData[k]; dup {
			errs = append(errs, field.Duplicate(field.NewPath("binaryData").Key(k), k))
		}
	}
	for k := range cm.BinaryData {
		for _, m := range validation.IsConfigMapKey(k) {
			errs = append(errs, field.Invalid(field.NewPath("binaryData").Key(k), k, m))
		}
	}
	return errs
}

func checkService(o *object, svc *corev1.Service, all []*object) field.ErrorList {
	var errs field.ErrorList
	spec := field.NewPath("spec")
	switch svc.Spec.Type {
	case "", corev1.ServiceTypeClusterIP, corev1.ServiceTypeNodePort, corev1.ServiceTypeLoadBalancer:
	case corev1.ServiceTypeExternalName:
		return errs
	default:
		errs = append(errs, field.NotSupported(spec.Child("type"), svc.Spec.Type,
			[]string{"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"}))
	}
	headless := svc.Spec.ClusterIP == corev1.ClusterIPNone
	if len(svc.Spec.Ports) == 0 && !headless {
		errs = append(errs, field.Required(spec.Child("ports"), "a non-headless Service needs ports"))
	}
	names := map[string]bool{}
	for i, p := range svc.Spec.Ports {
		pp := spec.Child("ports").Index(i)
		if len(svc.Spec.Ports) > 1 && p.Name == "" {
			errs = append(errs, field.Required(pp.Child("name"), "required when there is more than one port"))
		}
		if p.Name != "" {
			if names[p.Name] {
				errs = append(errs, field.Duplicate(pp.Child("name"), p.Name))
			}
			names[p.Name] = true
			for _, m := range validation.IsDNS1123Label(p.Name) {
				errs = append(errs, field.Invalid(pp.Child("name"), p.Name, m))
			}
		}
		for _, m := range validation.IsValidPortNum(int(p.Port)) {
			errs = append(errs, field.Invalid(pp.Child("port"), p.Port, m))
		}
		errs = append(errs, checkProtocol(p.Protocol, pp.Child("protocol"))...)
		errs = append(errs, checkPortRef(p.TargetPort, pp.Child("targetPort"), true)...)
	}
	if len(svc.Spec.Selector) == 0 {
		return errs
	}
	errs = append(errs, metavalidation.ValidateLabels(svc.Spec.Selector, spec.Child("selector"))...)
	// Cross-check: the selector picks a pod template given alongside, and a named targetPort
	// names one of that template's container ports.
	sel := labels.SelectorFromSet(svc.Spec.Selector)
	var matched []*corev1.PodTemplateSpec
	for _, other := range all {
		if t := podTemplate(other); t != nil && other.meta.Namespace == o.meta.Namespace &&
			sel.Matches(labels.Set(t.Labels)) {
			matched = append(matched, t)
		}
	}
	if len(matched) == 0 {
		if hasWorkload(all) {
			errs = append(errs, field.Invalid(spec.Child("selector"), svc.Spec.Selector,
				"selects no pod template among the objects given"))
		}
		return errs
	}
	for i, p := range svc.Spec.Ports {
		if p.TargetPort.Type != intstr.String {
			continue
		}
		for _, t := range matched {
			if !hasContainerPort(&t.Spec, p.TargetPort.StrVal) {
				errs = append(errs, field.Invalid(spec.Child("ports").Index(i).Child("targetPort"),
					p.TargetPort.StrVal, "no container port of that name in the selected pod template"))
			}
		}
	}
	return errs
}

func podTemplate(o *object) *corev1.PodTemplateSpec {
	if ds, ok := o.obj.(*appsv1.DaemonSet); ok {
		return &ds.Spec.Template
	}
	return nil
}

func hasWorkload(all []*object) bool {
	for _, o := range all {
		if podTemplate(o) != nil {
			return true
		}
	}
	return false
}

func hasContainerPort(spec *corev1.PodSpec, name string) bool {
	for _, c := range spec.Containers {
		for _, p := range c.Ports {
			if p.Name == name {
				return true
			}
		}
	}
	return false
}

func checkProtocol(p corev1.Protocol, path *field.Path) field.ErrorList {
	switch p {
	case "", corev1.ProtocolTCP, corev1.ProtocolUDP, corev1.ProtocolSCTP:
		return nil
	}
	return field.ErrorList{field.NotSupported(path, p, []string{"TCP", "UDP", "SCTP"})}
}

// checkPortRef: a number in 1..65535 or an IANA service name; empty allowed when optional.
func checkPortRef(p intstr.IntOrString, path *field.Path, optional bool) field.ErrorList {
	var errs field.ErrorList
	switch {
	case p.Type == intstr.Int && p.IntVal == 0 && optional:
	case p.Type == intstr.Int:
		for _, m := range validation.IsValidPortNum(int(p.IntVal)) {
			errs = append(errs, field.Invalid(path, p.IntVal, m))
		}
	default:
		for _, m := range validation.IsValidPortName(p.StrVal) {
			errs = append(errs, field.Invalid(path, p.StrVal, m))
		}
	}
	return errs
}

func checkDaemonSet(o *object, ds *appsv1.DaemonSet, all []*object) field.ErrorList {
	var errs field.ErrorList
	spec := field.NewPath("spec")
	tmpl := spec.Child("template")
	if ds.Spec.Selector == nil ||
		(len(ds.Spec.Selector.MatchLabels) == 0 && len(ds.Spec.Selector.MatchExpressions) == 0) {
		errs = append(errs, field.Required(spec.Child("selector"), "a DaemonSet needs a non-empty selector"))
	} else {
		errs = append(errs, metavalidation.ValidateLabelSelector(ds.Spec.Selector,
			metavalidation.LabelSelectorValidationOptions{}, spec.Child("selector"))...)
		sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
		if err != nil {
			errs = append(errs, field.Invalid(spec.Child("selector"), ds.Spec.Selector, err.Error()))
		} else if !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
			errs = append(errs, field.Invalid(tmpl.Child("metadata", "labels"),
				ds.Spec.Template.Labels, "`selector` does not match template `labels`"))
		}
	}
	errs = append(errs, metavalidation.ValidateLabels(ds.Spec.Template.Labels,
		tmpl.Child("metadata", "labels"))...)
	errs = append(errs, apivalidation.ValidateAnnotations(ds.Spec.Template.Annotations,
		tmpl.Child("metadata", "annotations"))...)
	switch ds.Spec.UpdateStrategy.Type {
	case "", appsv1.OnDeleteDaemonSetStrategyType:
	case appsv1.RollingUpdateDaemonSetStrategyType:
		if ru := ds.Spec.UpdateStrategy.RollingUpdate; ru != nil && ru.MaxUnavailable != nil {
			if _, err := intstr.GetScaledValueFromIntOrPercent(ru.MaxUnavailable, 100, true); err != nil {
				errs = append(errs, field.Invalid(spec.Child("updateStrategy", "rollingUpdate", "maxUnavailable"),
					ru.MaxUnavailable.String(), err.Error()))
			}
		}
	default:
		errs = append(errs, field.NotSupported(spec.Child("updateStrategy", "type"),
			ds.Spec.UpdateStrategy.Type, []string{"RollingUpdate", "OnDelete"}))
	}
	if rp := ds.Spec.Template.Spec.RestartPolicy; rp != "" && rp != corev1.RestartPolicyAlways {
		errs = append(errs, field.NotSupported(tmpl.Child("spec", "restartPolicy"), rp, []string{"Always"}))
	}
	errs = append(errs, checkPodSpec(o, &ds.Spec.Template.Spec, tmpl.Child("spec"), all)...)
	return errs
}

func checkPodSpec(o *object, ps *corev1.PodSpec, path *field.Path, all []*object) field.ErrorList {
	var errs field.ErrorList
	if len(ps.Containers) == 0 {
		errs = append(errs, field.Required(path.Child("containers"), "at least one container"))
	}
	volumes := map[string]*corev1.Volume{}
	for i := range ps.Volumes {
		v := &ps.Volumes[i]
		vp := path.Child("volumes").Index(i)
		for _, m := range validation.IsDNS1123Label(v.Name) {
			errs = append(errs, field.Invalid(vp.Child("name"), v.Name, m))
		}
		if volumes[v.Name] != nil {
			errs = append(errs, field.Duplicate(vp.Child("name"), v.Name))
		}
		volumes[v.Name] = v
		errs = append(errs, checkVolumeSource(o, v, vp, all)...)
	}
	names := map[string]bool{}
	for _, group := range []struct {
		name string
		list []corev1.Container
	}{{"initContainers", ps.InitContainers}, {"containers", ps.Containers}} {
		for i := range group.list {
			c := &group.list[i]
			cp := path.Child(group.name).Index(i)
			if c.Name == "" {
				errs = append(errs, field.Required(cp.Child("name"), ""))
			} else {
				for _, m := range validation.IsDNS1123Label(c.Name) {
					errs = append(errs, field.Invalid(cp.Child("name"), c.Name, m))
				}
				if names[c.Name] {
					errs = append(errs, field.Duplicate(cp.Child("name"), c.Name))
				}
				names[c.Name] = true
			}
			if strings.TrimSpace(c.Image) == "" {
				errs = append(errs, field.Required(cp.Child("image"), ""))
			}
			errs = append(errs, checkContainer(c, cp, volumes)...)
		}
	}
	for i, t := range ps.Tolerations {
		errs = append(errs, checkToleration(t, path.Child("tolerations").Index(i))...)
	}
	errs = append(errs, metavalidation.ValidateLabels(ps.NodeSelector, path.Child("nodeSelector"))...)
	if ps.TerminationGracePeriodSeconds != nil && *ps.TerminationGracePeriodSeconds < 0 {
		errs = append(errs, field.Invalid(path.Child("terminationGracePeriodSeconds"),
			*ps.TerminationGracePeriodSeconds, "must be >= 0"))
	}
	switch ps.DNSPolicy {
	case "", corev1.DNSClusterFirst, corev1.DNSClusterFirstWithHostNet, corev1.DNSDefault, corev1.DNSNone:
	default:
		errs = append(errs, field.NotSupported(path.Child("dnsPolicy"), ps.DNSPolicy,
			[]string{"ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"}))
	}
	if ps.SecurityContext != nil {
		errs = append(errs, checkSeccomp(ps.SecurityContext.SeccompProfile, path.Child("securityContext", "seccompProfile"))...)
	}
	if sa := ps.ServiceAccountName; sa != "" {
		for _, m := range validation.IsDNS1123Subdomain(sa) {
			errs = append(errs, field.Invalid(path.Child("serviceAccountName"), sa, m))
		}
		if sa != "default" && !defined(all, "ServiceAccount", o.meta.Namespace, sa) {
			errs = append(errs, field.NotFound(path.Child("serviceAccountName"), sa+
				" (no ServiceAccount of that name in this namespace among the objects given)"))
		}
	}
	return errs
}

func defined(all []*object, kind, ns, name string) bool {
	for _, o := range all {
		if o.gvk.Kind == kind && o.meta.Namespace == ns && o.meta.Name == name {
			return true
		}
	}
	return false
}

func checkVolumeSource(o *object, v *corev1.Volume, vp *field.Path, all []*object) field.ErrorList {
	var errs field.ErrorList
	// Exactly one source: count the non-nil pointer fields of VolumeSource.
	src := reflect.ValueOf(v.VolumeSource)
	n := 0
	for i := 0; i < src.NumField(); i++ {
		if !src.Field(i).IsNil() {
			n++
		}
	}
	if n != 1 {
		errs = append(errs, field.Invalid(vp, v.Name, fmt.Sprintf("must have exactly one volume source, has %d", n)))
	}
	if hp := v.HostPath; hp != nil {
		if !strings.HasPrefix(hp.Path, "/") {
			errs = append(errs, field.Invalid(vp.Child("hostPath", "path"), hp.Path, "must be an absolute path"))
		}
		if hp.Type != nil {
			switch *hp.Type {
			case corev1.HostPathUnset, corev1.HostPathDirectoryOrCreate, corev1.HostPathDirectory,
				corev1.HostPathFileOrCreate, corev1.HostPathFile, corev1.HostPathSocket,
				corev1.HostPathCharDev, corev1.HostPathBlockDev:
			default:
				errs = append(errs, field.NotSupported[corev1.HostPathType](vp.Child("hostPath", "type"), *hp.Type, nil))
			}
		}
	}
	if cm := v.ConfigMap; cm != nil {
		optional := cm.Optional != nil && *cm.Optional
		if cm.Name == "" {
			errs = append(errs, field.Required(vp.Child("configMap", "name"), ""))
		} else if !optional && !defined(all, "ConfigMap", o.meta.Namespace, cm.Name) {
			errs = append(errs, field.NotFound(vp.Child("configMap", "name"), cm.Name+
				" (no ConfigMap of that name in this namespace among the objects given)"))
		}
		for i, item := range cm.Items {
			if item.Key == "" || item.Path == "" || strings.HasPrefix(item.Path, "/") ||
				strings.Contains(item.Path, "..") {
				errs = append(errs, field.Invalid(vp.Child("configMap", "items").Index(i), item,
					"key and a relative path (no '..') are required"))
			}
		}
	}
	return errs
}

func checkContainer(c *corev1.Container, cp *field.Path, volumes map[string]*corev1.Volume) field.ErrorList {
	var errs field.ErrorList
	ports := map[string]bool{}
	for i, p := range c.Ports {
		pp := cp.Child("ports").Index(i)
		for _, m := range validation.IsValidPortNum(int(p.ContainerPort)) {
			errs = append(errs, field.Invalid(pp.Child("containerPort"), p.ContainerPort, m))
		}
		if p.HostPort != 0 {
			for _, m := range validation.IsValidPortNum(int(p.HostPort)) {
				errs = append(errs, field.Invalid(pp.Child("hostPort"), p.HostPort, m))
			}
		}
		if p.Name != "" {
			for _, m := range validation.IsValidPortName(p.Name) {
				errs = append(errs, field.Invalid(pp.Child("name"), p.Name, m))
			}
			if ports[p.Name] {
				errs = append(errs, field.Duplicate(pp.Child("name"), p.Name))
			}
			ports[p.Name] = true
		}
		errs = append(errs, checkProtocol(p.Protocol, pp.Child("protocol"))...)
	}
	mountPaths := map[string]bool{}
	for i, m := range c.VolumeMounts {
		mp := cp.Child("volumeMounts").Index(i)
		if volumes[m.Name] == nil {
			errs = append(errs, field.NotFound(mp.Child("name"), m.Name))
		}
		if !strings.HasPrefix(m.MountPath, "/") {
			errs = append(errs, field.Invalid(mp.Child("mountPath"), m.MountPath, "must be an absolute path"))
		}
		if mountPaths[m.MountPath] {
			errs = append(errs, field.Duplicate(mp.Child("mountPath"), m.MountPath))
		}
		mountPaths[m.MountPath] = true
	}
	envNames := map[string]bool{}
	for i, e := range c.Env {
		ep := cp.Child("env").Index(i)
		if e.Name == "" {
			errs = append(errs, field.Required(ep.Child("name"), ""))
		}
		for _, m := range validation.IsEnvVarName(e.Name) {
			errs = append(errs, field.Invalid(ep.Child("name"), e.Name, m))
		}
		if envNames[e.Name] {
			errs = append(errs, field.Duplicate(ep.Child("name"), e.Name))
		}
		envNames[e.Name] = true
		if e.ValueFrom != nil {
			errs = append(errs, checkEnvSource(e, ep)...)
		}
	}
	for name, probe := range map[string]*corev1.Probe{
		"livenessProbe": c.LivenessProbe, "readinessProbe": c.ReadinessProbe, "startupProbe": c.StartupProbe,
	} {
		if probe != nil {
			errs = append(errs, checkProbe(probe, cp.Child(name), ports)...)
		}
	}
	for res, lim := range c.Resources.Limits {
		if req, ok := c.Resources.Requests[res]; ok && req.Cmp(lim) > 0 {
			errs = append(errs, field.Invalid(cp.Child("resources", "requests").Key(string(res)),
				req.String(), "must be less than or equal to the limit "+lim.String()))
		}
	}
	if sc := c.SecurityContext; sc != nil {
		errs = append(errs, checkSeccomp(sc.SeccompProfile, cp.Child("securityContext", "seccompProfile"))...)
		if sc.Privileged != nil && *sc.Privileged && sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
			errs = append(errs, field.Invalid(cp.Child("securityContext", "allowPrivilegeEscalation"), false,
				"cannot be false when privileged is true"))
		}
		if sc.Capabilities != nil && sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
			for _, c := range sc.Capabilities.Add {
				if strings.TrimPrefix(string(c), "CAP_") == "SYS_ADMIN" {
					errs = append(errs, field.Invalid(cp.Child("securityContext", "allowPrivilegeEscalation"), false,
						"cannot be false when CAP_SYS_ADMIN is added"))
				}
			}
		}
	}
	return errs
}

var envFieldPaths = map[string]bool{
	"metadata.name": true, "metadata.namespace": true, "metadata.uid": true,
	"spec.nodeName": true, "spec.serviceAccountName": true, "status.hostIP": true,
	"status.hostIPs": true, "status.podIP": true, "status.podIPs": true,
}

func checkEnvSource(e corev1.EnvVar, ep *field.Path) field.ErrorList {
	var errs field.ErrorList
	if e.Value != "" {
		errs = append(errs, field.Invalid(ep.Child("valueFrom"), "", "may not be specified when `value` is not empty"))
	}
	vf := e.ValueFrom
	n := 0
	if vf.FieldRef != nil {
		n++
		p := vf.FieldRef.FieldPath
		ok := envFieldPaths[p] || strings.HasPrefix(p, "metadata.labels[") ||
			strings.HasPrefix(p, "metadata.annotations[")
		if !ok {
			errs = append(errs, field.NotSupported[string](ep.Child("valueFrom", "fieldRef", "fieldPath"), p, nil))
		}
	}
	if vf.ResourceFieldRef != nil {
		n++
	}
	if vf.ConfigMapKeyRef != nil {
		n++
	}
	if vf.SecretKeyRef != nil {
		n++
	}
	if vf.FileKeyRef != nil {
		n++
	}
	if n != 1 {
		errs = append(errs, field.Invalid(ep.Child("valueFrom"), n, "must specify exactly one source"))
	}
	return errs
}

func checkProbe(p *corev1.Probe, pp *field.Path, ports map[string]bool) field.ErrorList {
	var errs field.ErrorList
	n := 0
	if p.HTTPGet != nil {
		n++
		if !strings.HasPrefix(p.HTTPGet.Path, "/") {
			errs = append(errs, field.Invalid(pp.Child("httpGet", "path"), p.HTTPGet.Path, "must start with /"))
		}
		errs = append(errs, checkPortRef(p.HTTPGet.Port, pp.Child("httpGet", "port"), false)...)
		if p.HTTPGet.Port.Type == intstr.String && !ports[p.HTTPGet.Port.StrVal] {
			errs = append(errs, field.NotFound(pp.Child("httpGet", "port"), p.HTTPGet.Port.StrVal))
		}
		switch p.HTTPGet.Scheme {
		case "", corev1.URISchemeHTTP, corev1.URISchemeHTTPS:
		default:
			errs = append(errs, field.NotSupported(pp.Child("httpGet", "scheme"), p.HTTPGet.Scheme, []string{"HTTP", "HTTPS"}))
		}
	}
	if p.TCPSocket != nil {
		n++
	}
	if p.Exec != nil {
		n++
	}
	if p.GRPC != nil {
		n++
	}
	if n != 1 {
		errs = append(errs, field.Invalid(pp, n, "must specify exactly one handler"))
	}
	for name, v := range map[string]int32{
		"initialDelaySeconds": p.InitialDelaySeconds, "timeoutSeconds": p.TimeoutSeconds,
		"periodSeconds": p.PeriodSeconds, "successThreshold": p.SuccessThreshold,
		"failureThreshold": p.FailureThreshold,
	} {
		if v < 0 {
			errs = append(errs, field.Invalid(pp.Child(name), v, "must be >= 0"))
		}
	}
	return errs
}

func checkToleration(t corev1.Toleration, tp *field.Path) field.ErrorList {
	var errs field.ErrorList
	if t.Key != "" {
		errs = append(errs, metavalidation.ValidateLabelName(t.Key, tp.Child("key"))...)
	}
	switch t.Operator {
	case corev1.TolerationOpExists:
		if t.Value != "" {
			errs = append(errs, field.Invalid(tp.Child("value"), t.Value, "must be empty when operator is Exists"))
		}
	case "", corev1.TolerationOpEqual:
		if t.Key == "" {
			errs = append(errs, field.Invalid(tp.Child("operator"), t.Operator, "must be Exists when key is empty"))
		}
	default:
		errs = append(errs, field.NotSupported(tp.Child("operator"), t.Operator, []string{"Equal", "Exists"}))
	}
	switch t.Effect {
	case "", corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule, corev1.TaintEffectNoExecute:
	default:
		errs = append(errs, field.NotSupported(tp.Child("effect"), t.Effect,
			[]string{"NoSchedule", "PreferNoSchedule", "NoExecute"}))
	}
	if t.TolerationSeconds != nil && t.Effect != corev1.TaintEffectNoExecute {
		errs = append(errs, field.Invalid(tp.Child("tolerationSeconds"), *t.TolerationSeconds,
			"only allowed with effect NoExecute"))
	}
	return errs
}

func checkSeccomp(p *corev1.SeccompProfile, path *field.Path) field.ErrorList {
	if p == nil {
		return nil
	}
	switch p.Type {
	case corev1.SeccompProfileTypeLocalhost:
		if p.LocalhostProfile == nil || *p.LocalhostProfile == "" {
			return field.ErrorList{field.Required(path.Child("localhostProfile"), "required for type Localhost")}
		}
		// Relative to the kubelet's <root-dir>/seccomp, and may not leave it (the API
		// server's validateLocalDescendingPath).
		lp := *p.LocalhostProfile
		if strings.HasPrefix(lp, "/") || slices.Contains(strings.Split(lp, "/"), "..") {
			return field.ErrorList{field.Invalid(path.Child("localhostProfile"), lp,
				"must be a relative path that does not contain '..'")}
		}
	case corev1.SeccompProfileTypeRuntimeDefault, corev1.SeccompProfileTypeUnconfined:
		if p.LocalhostProfile != nil {
			return field.ErrorList{field.Invalid(path.Child("localhostProfile"), *p.LocalhostProfile,
				"only allowed for type Localhost")}
		}
	default:
		return field.ErrorList{field.NotSupported(path.Child("type"), p.Type,
			[]string{"RuntimeDefault", "Unconfined", "Localhost"})}
	}
	return nil
}

func checkRules(rules []rbacv1.PolicyRule, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	for i, r := range rules {
		rp := path.Index(i)
		if len(r.Verbs) == 0 {
			errs = append(errs, field.Required(rp.Child("verbs"), "at least one verb"))
		}
		if len(r.NonResourceURLs) > 0 {
			if len(r.APIGroups) > 0 || len(r.Resources) > 0 {
				errs = append(errs, field.Invalid(rp.Child("nonResourceURLs"), r.NonResourceURLs,
					"rules cannot apply to both regular resources and non-resource URLs"))
			}
			continue
		}
		if len(r.APIGroups) == 0 {
			errs = append(errs, field.Required(rp.Child("apiGroups"), "at least one (\"\" for the core group)"))
		}
		if len(r.Resources) == 0 {
			errs = append(errs, field.Required(rp.Child("resources"), "at least one resource"))
		}
	}
	return errs
}

func checkBinding(ref rbacv1.RoleRef, subjects []rbacv1.Subject, cluster bool, ns string) field.ErrorList {
	var errs field.ErrorList
	rr := field.NewPath("roleRef")
	if ref.APIGroup != rbacv1.GroupName {
		errs = append(errs, field.NotSupported(rr.Child("apiGroup"), ref.APIGroup, []string{rbacv1.GroupName}))
	}
	switch {
	case ref.Kind == "ClusterRole":
	case ref.Kind == "Role" && !cluster:
	default:
		errs = append(errs, field.NotSupported(rr.Child("kind"), ref.Kind, []string{"Role", "ClusterRole"}))
	}
	if ref.Name == "" {
		errs = append(errs, field.Required(rr.Child("name"), ""))
	}
	for i, s := range subjects {
		sp := field.NewPath("subjects").Index(i)
		if s.Name == "" {
			errs = append(errs, field.Required(sp.Child("name"), ""))
		}
		switch s.Kind {
		case rbacv1.ServiceAccountKind:
			if s.APIGroup != "" {
				errs = append(errs, field.NotSupported(sp.Child("apiGroup"), s.APIGroup, []string{""}))
			}
			if s.Namespace == "" && (cluster || ns == "") {
				errs = append(errs, field.Required(sp.Child("namespace"), "required for a ServiceAccount subject"))
			}
		case rbacv1.UserKind, rbacv1.GroupKind:
			if s.APIGroup != rbacv1.GroupName {
				errs = append(errs, field.NotSupported(sp.Child("apiGroup"), s.APIGroup, []string{rbacv1.GroupName}))
			}
		default:
			errs = append(errs, field.NotSupported(sp.Child("kind"), s.Kind, []string{"ServiceAccount", "User", "Group"}))
		}
	}
	return errs
}

// checkNetworkPolicy: the API server's rules for the fields a node agent's policy uses, and a
// cross-check that the policy selects pods of a workload given with it, on ports they declare.
func checkNetworkPolicy(o *object, np *networkingv1.NetworkPolicy, all []*object) field.ErrorList {
	var errs field.ErrorList
	spec := field.NewPath("spec")
	opts := metavalidation.LabelSelectorValidationOptions{}
	errs = append(errs, metavalidation.ValidateLabelSelector(&np.Spec.PodSelector, opts, spec.Child("podSelector"))...)
	for i, t := range np.Spec.PolicyTypes {
		if t != networkingv1.PolicyTypeIngress && t != networkingv1.PolicyTypeEgress {
			errs = append(errs, field.NotSupported(spec.Child("policyTypes").Index(i), t,
				[]string{"Ingress", "Egress"}))
		}
	}
	sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
	if err != nil {
		return append(errs, field.Invalid(spec.Child("podSelector"), np.Spec.PodSelector, err.Error()))
	}
	var selected []*corev1.PodSpec
	for _, other := range all {
		if t := podTemplate(other); t != nil && other.meta.Namespace == o.meta.Namespace &&
			sel.Matches(labels.Set(t.Labels)) {
			selected = append(selected, &t.Spec)
		}
	}
	if len(selected) == 0 {
		errs = append(errs, field.Invalid(spec.Child("podSelector"), np.Spec.PodSelector,
			"selects no workload among the objects given"))
	}
	for i, rule := range np.Spec.Ingress {
		rp := spec.Child("ingress").Index(i)
		for j, port := range rule.Ports {
			pp := rp.Child("ports").Index(j)
			if port.Protocol != nil {
				errs = append(errs, checkProtocol(*port.Protocol, pp.Child("protocol"))...)
			}
			if port.Port == nil {
				continue
			}
			if port.Port.Type == intstr.String {
				for _, m := range validation.IsValidPortName(port.Port.StrVal) {
					errs = append(errs, field.Invalid(pp.Child("port"), port.Port.StrVal, m))
				}
				for _, ps := range selected {
					if !hasContainerPort(ps, port.Port.StrVal) {
						errs = append(errs, field.NotFound(pp.Child("port"), port.Port.StrVal+
							" (no container port of that name in the selected pods)"))
					}
				}
			} else {
				for _, m := range validation.IsValidPortNum(int(port.Port.IntVal)) {
					errs = append(errs, field.Invalid(pp.Child("port"), port.Port.IntVal, m))
				}
			}
		}
		for j, peer := range rule.From {
			fp := rp.Child("from").Index(j)
			n := 0
			if peer.PodSelector != nil {
				n++
				errs = append(errs, metavalidation.ValidateLabelSelector(peer.PodSelector, opts, fp.Child("podSelector"))...)
			}
			if peer.NamespaceSelector != nil {
				n++
				errs = append(errs, metavalidation.ValidateLabelSelector(peer.NamespaceSelector, opts, fp.Child("namespaceSelector"))...)
			}
			if peer.IPBlock != nil {
				if n > 0 {
					errs = append(errs, field.Forbidden(fp, "may not specify ipBlock with another peer type"))
				}
				n++
				if peer.IPBlock.CIDR == "" {
					errs = append(errs, field.Required(fp.Child("ipBlock", "cidr"), ""))
				}
			}
			if n == 0 {
				errs = append(errs, field.Required(fp, "must specify a peer"))
			}
		}
	}
	return errs
}
