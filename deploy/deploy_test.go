// Package deploy holds pullproxy's deployment files and no code. Its tests
// read each file as the tool that consumes it would, with no cluster and no
// network, so that a file which no longer fits pullproxy fails here rather
// than at a site.
//
// It is a module of its own: what its tests read the files with (kustomize,
// Kubernetes' API types, Prometheus's PromQL parser) is no dependency of
// pullproxy's; `make test` runs these tests too.
package deploy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	sigsyaml "sigs.k8s.io/yaml"
)

// shutdownGrace is how long pullproxy waits for responses after SIGTERM; every
// supervisor must give it longer before killing it.
const shutdownGrace = 20 * time.Second

type metricType int

const (
	counter metricType = iota
	gauge
	histogram
)

// exported lists the metrics pullproxy serves on /metrics. Rules and
// dashboards may name nothing else of pullproxy's, and the dashboard shows
// each of them.
var exported = map[string]metricType{
	"pullproxy_http_requests_total":               counter,
	"pullproxy_http_request_duration_seconds":     histogram,
	"pullproxy_http_connections_refused_total":    counter,
	"pullproxy_http_connections_open":             gauge,
	"pullproxy_cache_requests_total":              counter,
	"pullproxy_blob_served_bytes_total":           counter,
	"pullproxy_stale_served_total":                counter,
	"pullproxy_blob_fetches_total":                counter,
	"pullproxy_blob_verification_failures_total":  counter,
	"pullproxy_downloads_in_flight":               gauge,
	"pullproxy_download_waiters":                  gauge,
	"pullproxy_upstream_requests_total":           counter,
	"pullproxy_upstream_blob_bytes_total":         counter,
	"pullproxy_upstream_connection_budget_bytes":  gauge,
	"pullproxy_upstream_connection_cuts_total":    counter,
	"pullproxy_upstream_retries_total":            counter,
	"pullproxy_upstream_chunks_total":             counter,
	"pullproxy_upstream_connections_limit":        gauge,
	"pullproxy_upstream_connections_in_flight":    gauge,
	"pullproxy_upstream_ratelimit_remaining":      gauge,
	"pullproxy_upstream_ratelimit_limit":          gauge,
	"pullproxy_upstream_endpoint_up":              gauge,
	"pullproxy_ecr_token_renewals_total":          counter,
	"pullproxy_store_damaged_blobs_total":         counter,
	"pullproxy_scrub_read_bytes_total":            counter,
	"pullproxy_store_bytes":                       gauge,
	"pullproxy_store_blobs":                       gauge,
	"pullproxy_store_max_bytes":                   gauge,
	"pullproxy_store_filesystem_free_bytes":       gauge,
	"pullproxy_store_filesystem_size_bytes":       gauge,
	"pullproxy_evicted_blobs_total":               counter,
	"pullproxy_evicted_bytes_total":               counter,
	"pullproxy_bucket_requests_total":             counter,
	"pullproxy_bucket_read_bytes_total":           counter,
	"pullproxy_bucket_written_bytes_total":        counter,
	"pullproxy_bucket_blob_fetches_total":         counter,
	"pullproxy_bucket_lease_takeovers_total":      counter,
	"pullproxy_bucket_degraded":                   gauge,
	"pullproxy_bucket_degraded_total":             counter,
	"pullproxy_bucket_writes_dropped_total":       counter,
	"pullproxy_sync_rounds_total":                 counter,
	"pullproxy_sync_fetched_bytes_total":          counter,
	"pullproxy_sync_tags_cached":                  gauge,
	"pullproxy_sync_failures":                     gauge,
	"pullproxy_sync_last_round_timestamp_seconds": gauge,
	"pullproxy_sync_next_round_timestamp_seconds": gauge,
}

// others are the series from client_golang's Go and process collectors, and
// Prometheus's own, that the rules and dashboard use.
var others = map[string]metricType{
	"up":                            gauge,
	"process_cpu_seconds_total":     counter,
	"process_resident_memory_bytes": gauge,
	"process_open_fds":              gauge,
	"go_memstats_heap_inuse_bytes":  gauge,
	"go_goroutines":                 gauge,
}

// seriesType resolves a series name to its metric's type, a histogram's
// _bucket, _sum and _count series counting as counters.
func seriesType(name string) (base string, typ metricType, ok bool) {
	if typ, ok := exported[name]; ok && typ != histogram {
		return name, typ, true
	}
	if typ, ok := others[name]; ok {
		return name, typ, true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if b, found := strings.CutSuffix(name, suffix); found && exported[b] == histogram {
			return b, counter, true
		}
	}
	return "", 0, false
}

// promql parses expr and checks the series it names: known ones only, and
// counters only under rate, irate and increase. It returns the metrics named.
func promql(expr string) ([]string, error) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	var names []string
	var errs []error
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			base, _, ok := seriesType(n.Name)
			if !ok {
				errs = append(errs, fmt.Errorf("unknown series %q", n.Name))
				break
			}
			names = append(names, base)
		case *parser.Call:
			if n.Func.Name != "rate" && n.Func.Name != "irate" && n.Func.Name != "increase" {
				break
			}
			for _, arg := range n.Args {
				m, ok := arg.(*parser.MatrixSelector)
				if !ok {
					continue
				}
				if vs, ok := m.VectorSelector.(*parser.VectorSelector); ok {
					if _, typ, ok := seriesType(vs.Name); ok && typ != counter {
						errs = append(errs, fmt.Errorf("%s of %s, which is not a counter", n.Func.Name, vs.Name))
					}
				}
			}
		}
		return nil
	})
	return names, errors.Join(errs...)
}

// pullproxyName finds metric names in text that is not PromQL (a Grafana
// variable's query).
var pullproxyName = regexp.MustCompile(`\bpullproxy_[a-z0-9_]+`)

func TestAlertRules(t *testing.T) {
	type rule struct {
		Alert       string            `yaml:"alert"`
		Expr        string            `yaml:"expr"`
		For         string            `yaml:"for"`
		Labels      map[string]string `yaml:"labels"`
		Annotations map[string]string `yaml:"annotations"`
	}
	var file struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []rule `yaml:"rules"`
		} `yaml:"groups"`
	}
	decodeYAMLStrict(t, "prometheus/pullproxy-alerts.yaml", &file)
	if len(file.Groups) == 0 {
		t.Fatal("no rule groups")
	}

	// What Prometheus defines around an annotation before expanding it, and
	// the functions it offers there.
	const templateVars = "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$externalURL := .ExternalURL}}{{$value := .Value}}"
	funcs := template.FuncMap{}
	for _, name := range []string{"humanize", "humanize1024", "humanizeDuration", "humanizePercentage",
		"humanizeTimestamp", "toUpper", "toLower", "title", "match", "reReplaceAll", "label", "value",
		"first", "query", "args", "safeHtml", "externalURL", "pathPrefix", "toTime", "toDuration",
		"parseDuration", "urlQueryEscape", "stripPort", "stripDomain", "sortByLabel", "graphLink", "tableLink"} {
		funcs[name] = func(...any) string { return "" }
	}

	seen := map[string]bool{}
	groups := map[string]bool{}
	for _, g := range file.Groups {
		if g.Name == "" || groups[g.Name] {
			t.Errorf("group %q: empty or repeated name", g.Name)
		}
		groups[g.Name] = true
		if len(g.Rules) == 0 {
			t.Errorf("group %s: no rules", g.Name)
		}
		for _, r := range g.Rules {
			t.Run(r.Alert, func(t *testing.T) {
				if !regexp.MustCompile(`^Pullproxy[A-Z][A-Za-z0-9]*$`).MatchString(r.Alert) {
					t.Errorf("alert name %q: want Pullproxy followed by CamelCase", r.Alert)
				}
				if seen[r.Alert] {
					t.Errorf("alert %s defined twice", r.Alert)
				}
				seen[r.Alert] = true
				if _, err := promql(r.Expr); err != nil {
					t.Errorf("expr: %v\n%s", err, r.Expr)
				}
				if r.For != "" {
					if _, err := model.ParseDuration(r.For); err != nil {
						t.Errorf("for: %v", err)
					}
				}
				switch r.Labels["severity"] {
				case "critical", "warning", "info":
				default:
					t.Errorf("labels.severity = %q, want critical, warning or info", r.Labels["severity"])
				}
				for _, key := range []string{"summary", "description"} {
					if strings.TrimSpace(r.Annotations[key]) == "" {
						t.Errorf("annotations.%s is empty", key)
					}
				}
				for key, text := range r.Annotations {
					if _, err := template.New(key).Funcs(funcs).Parse(templateVars + text); err != nil {
						t.Errorf("annotations.%s: %v", key, err)
					}
				}
			})
		}
	}
}

func TestDashboard(t *testing.T) {
	type target struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	}
	type datasource struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	}
	type panel struct {
		ID         int         `json:"id"`
		Type       string      `json:"type"`
		Title      string      `json:"title"`
		Datasource *datasource `json:"datasource"`
		Targets    []target    `json:"targets"`
	}
	// Only the parts checked: Grafana's model has far more fields than are
	// worth mirroring here.
	var dash struct {
		UID           string  `json:"uid"`
		Title         string  `json:"title"`
		SchemaVersion int     `json:"schemaVersion"`
		Panels        []panel `json:"panels"`
		Templating    struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	data, err := os.ReadFile("grafana/pullproxy-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	if dash.UID == "" || dash.Title == "" {
		t.Errorf("uid %q, title %q: want both", dash.UID, dash.Title)
	}
	if dash.SchemaVersion < 36 {
		t.Errorf("schemaVersion %d: want 36 or later (data sources as {type, uid})", dash.SchemaVersion)
	}

	// Panels query the data source the viewer picks.
	variables := map[string]string{}
	used := map[string]bool{}
	for _, v := range dash.Templating.List {
		variables[v.Name] = v.Type
		q, _ := json.Marshal(v.Query)
		for _, name := range pullproxyName.FindAllString(string(q), -1) {
			if _, _, ok := seriesType(name); !ok {
				t.Errorf("variable %s: unknown series %q", v.Name, name)
			}
		}
	}
	if variables["datasource"] != "datasource" {
		t.Errorf("no datasource variable; panels use ${datasource}")
	}

	// Grafana's interval variables are not PromQL; give them a value.
	intervals := strings.NewReplacer("$__rate_interval", "5m", "${__rate_interval}", "5m",
		"$__interval", "1m", "${__interval}", "1m", "$__range", "1h", "${__range}", "1h")
	ids := map[int]bool{}
	panels := 0
	for _, p := range dash.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Title == "" {
			t.Errorf("panel %d has no title", p.ID)
		}
		if p.Type == "row" {
			continue
		}
		panels++
		if p.Datasource == nil || p.Datasource.Type != "prometheus" || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource %+v, want prometheus ${datasource}", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no targets", p.Title)
		}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q target %s: empty expr", p.Title, tg.RefID)
				continue
			}
			names, err := promql(intervals.Replace(tg.Expr))
			if err != nil {
				t.Errorf("panel %q target %s: %v\n%s", p.Title, tg.RefID, err, tg.Expr)
			}
			for _, n := range names {
				used[n] = true
			}
		}
	}
	if panels < 8 {
		t.Errorf("%d panels, want at least 8", panels)
	}
	for name := range exported {
		if !used[name] {
			t.Errorf("no panel shows %s", name)
		}
	}
}

func TestSystemdUnit(t *testing.T) {
	unit := parseUnit(t, "systemd/pullproxy.service")
	for _, s := range []string{"Unit", "Service", "Install"} {
		if unit[s] == nil {
			t.Errorf("no [%s] section", s)
		}
	}
	service := unit["Service"]

	execStart := service["ExecStart"]
	if len(execStart) != 1 || !strings.HasPrefix(execStart[0], "/usr/local/bin/pullproxy serve ") {
		t.Fatalf("ExecStart = %q, want one /usr/local/bin/pullproxy serve ...", execStart)
	}
	args := strings.Fields(execStart[0])[2:]
	if config, ok := flagValue(args, "config"); !ok || !strings.HasPrefix(config, "/etc/") {
		t.Errorf("ExecStart: --config %q, want a file under /etc", config)
	}
	// The data dir is the state directory systemd makes writable for the service.
	if dir, _ := flagValue(args, "data-dir"); dir != "/var/lib/"+last(service["StateDirectory"]) {
		t.Errorf("ExecStart: --data-dir %q, want /var/lib/ + StateDirectory %q", dir, service["StateDirectory"])
	}

	for _, tc := range []struct {
		key, want string // want "": present, any value
	}{
		{"StateDirectory", "pullproxy"},
		{"ProtectSystem", "strict"},
		{"ProtectHome", "yes"},
		{"PrivateTmp", "yes"},
		{"NoNewPrivileges", "yes"},
		{"CapabilityBoundingSet", ""},
		{"RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"},
		{"SystemCallFilter", "@system-service"},
		{"MemoryDenyWriteExecute", "yes"},
		{"LimitNOFILE", "1048576"},
		{"Restart", "on-failure"},
		{"TimeoutStopSec", ""},
	} {
		values, ok := service[tc.key]
		switch {
		case !ok:
			t.Errorf("[Service] has no %s=", tc.key)
		case tc.want != "" && !slices.Contains(values, tc.want):
			t.Errorf("[Service] %s=%q, want %q among them", tc.key, values, tc.want)
		}
	}
	if service["DynamicUser"] == nil && service["User"] == nil {
		t.Error("[Service] runs as root: want DynamicUser= or User=")
	}
	if cb := service["CapabilityBoundingSet"]; len(cb) > 0 && last(cb) != "" {
		t.Errorf("CapabilityBoundingSet=%q, want empty: pullproxy needs no capability", last(cb))
	}
	if stop, err := unitSeconds(last(service["TimeoutStopSec"])); err != nil || stop <= shutdownGrace {
		t.Errorf("TimeoutStopSec=%q, want seconds beyond pullproxy's %v of grace", last(service["TimeoutStopSec"]), shutdownGrace)
	}
	if unit["Install"]["WantedBy"] == nil {
		t.Error("[Install] has no WantedBy=")
	}
}

// parseUnit reads a systemd unit file: sections of keys, each with the values
// of its assignments in order.
func parseUnit(t *testing.T, name string) map[string]map[string][]string {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	unit := map[string]map[string][]string{}
	var section map[string][]string
	var pending string
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if pending != "" {
			line, pending = pending+" "+line, ""
		}
		if cont, ok := strings.CutSuffix(line, `\`); ok {
			pending = strings.TrimSpace(cont)
			continue
		}
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
		case line[0] == '[':
			name, ok := strings.CutSuffix(line[1:], "]")
			if !ok || unit[name] != nil {
				t.Fatalf("%s:%d: bad or repeated section %q", f.Name(), n, line)
			}
			section = map[string][]string{}
			unit[name] = section
		default:
			key, value, ok := strings.Cut(line, "=")
			if !ok || section == nil {
				t.Fatalf("%s:%d: want key=value in a section: %q", f.Name(), n, line)
			}
			key = strings.TrimSpace(key)
			section[key] = append(section[key], strings.TrimSpace(value))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if pending != "" {
		t.Fatalf("%s: ends in a continuation", f.Name())
	}
	return unit
}

// unitSeconds reads a systemd time span: plain seconds, or with Go's units
// (systemd has more, which these files do not use).
func unitSeconds(s string) (time.Duration, error) {
	if n, err := strconv.Atoi(s); err == nil {
		return time.Duration(n) * time.Second, nil
	}
	return time.ParseDuration(s)
}

func last(values []string) string {
	if len(values) == 0 {
		return ""
	}
	return values[len(values)-1]
}

// flagValue finds --name VALUE or --name=VALUE in args.
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if !strings.HasPrefix(a, "-") {
			continue
		}
		a = strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-")
		if a == name && i+1 < len(args) {
			return args[i+1], true
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func decodeYAMLStrict(t *testing.T, name string, v any) {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
}

// serviceMonitor is the part of prometheus-operator's ServiceMonitor these
// manifests use.
type serviceMonitor struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name        string            `yaml:"name"`
		Namespace   string            `yaml:"namespace"`
		Labels      map[string]string `yaml:"labels"`
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
	Spec struct {
		JobLabel string `yaml:"jobLabel"`
		Selector struct {
			MatchLabels map[string]string `yaml:"matchLabels"`
		} `yaml:"selector"`
		NamespaceSelector struct {
			Any        bool     `yaml:"any"`
			MatchNames []string `yaml:"matchNames"`
		} `yaml:"namespaceSelector"`
		Endpoints []struct {
			Port          string `yaml:"port"`
			Path          string `yaml:"path"`
			Scheme        string `yaml:"scheme"`
			Interval      string `yaml:"interval"`
			ScrapeTimeout string `yaml:"scrapeTimeout"`
		} `yaml:"endpoints"`
	} `yaml:"spec"`
}

var (
	scheme = func() *runtime.Scheme {
		s := runtime.NewScheme()
		for _, add := range []func(*runtime.Scheme) error{appsv1.AddToScheme, corev1.AddToScheme, policyv1.AddToScheme} {
			if err := add(s); err != nil {
				panic(err)
			}
		}
		return s
	}()
	// The API server's own decoding: unknown and repeated fields are errors.
	strict = kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme,
		kjson.SerializerOptions{Yaml: true, Strict: true})
	serviceMonitorKind = schema.GroupVersionKind{Group: "monitoring.coreos.com", Version: "v1", Kind: "ServiceMonitor"}
)

// decodeObjects decodes each document of a manifest stream into its typed
// API object.
func decodeObjects(data []byte) ([]any, error) {
	var objs []any
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if err == io.EOF {
			return objs, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var tm metav1.TypeMeta
		if err := sigsyaml.Unmarshal(doc, &tm); err != nil {
			return nil, err
		}
		if tm.GroupVersionKind() == serviceMonitorKind {
			var sm serviceMonitor
			dec := yaml.NewDecoder(bytes.NewReader(doc))
			dec.KnownFields(true)
			if err := dec.Decode(&sm); err != nil {
				return nil, fmt.Errorf("%s: %w", tm.Kind, err)
			}
			objs = append(objs, &sm)
			continue
		}
		if !scheme.Recognizes(tm.GroupVersionKind()) {
			return nil, fmt.Errorf("unexpected kind %s", tm.GroupVersionKind())
		}
		obj, _, err := strict.Decode(doc, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", tm.Kind, err)
		}
		objs = append(objs, obj)
	}
}

// TestKustomizations checks each kustomization and every file it names, and
// that no file under kubernetes/ is left out of one.
func TestKustomizations(t *testing.T) {
	covered := map[string]bool{}
	var files []string
	err := filepath.WalkDir("kubernetes", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		files = append(files, p)
		if d.Name() != "kustomization.yaml" {
			return nil
		}
		covered[p] = true
		dir := filepath.Dir(p)
		t.Run(filepath.ToSlash(dir), func(t *testing.T) {
			k := readKustomization(t, p)
			for _, r := range k.Resources {
				rp := filepath.Join(dir, r)
				st, err := os.Stat(rp)
				switch {
				case err != nil:
					t.Errorf("resource %s: %v", r, err)
				case st.IsDir():
					if _, err := os.Stat(filepath.Join(rp, "kustomization.yaml")); err != nil {
						t.Errorf("resource %s: a directory without kustomization.yaml", r)
					}
				default:
					covered[rp] = true
					data, err := os.ReadFile(rp)
					if err != nil {
						t.Fatal(err)
					}
					if objs, err := decodeObjects(data); err != nil {
						t.Errorf("resource %s: %v", r, err)
					} else if len(objs) == 0 {
						t.Errorf("resource %s: no objects", r)
					}
				}
			}
			for _, p := range k.Patches {
				if p.Path == "" {
					continue
				}
				covered[filepath.Join(dir, p.Path)] = true
				if _, err := os.Stat(filepath.Join(dir, p.Path)); err != nil {
					t.Errorf("patch: %v", err)
				}
			}
			for _, g := range k.ConfigMapGenerator {
				for _, src := range g.FileSources {
					if _, file, ok := strings.Cut(src, "="); ok {
						src = file
					}
					covered[filepath.Join(dir, src)] = true
					if _, err := os.Stat(filepath.Join(dir, src)); err != nil {
						t.Errorf("configMapGenerator %s: %v", g.Name, err)
					}
				}
			}
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if !covered[f] {
			t.Errorf("%s is in no kustomization", f)
		}
	}
}

func readKustomization(t *testing.T, name string) types.Kustomization {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	var k types.Kustomization
	if err := sigsyaml.UnmarshalStrict(data, &k); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if k.APIVersion != types.KustomizationVersion || k.Kind != types.KustomizationKind {
		t.Errorf("%s: %s %s, want %s %s", name, k.APIVersion, k.Kind, types.KustomizationVersion, types.KustomizationKind)
	}
	// kustomize's own list of the fields it deprecates (what `kustomize
	// edit fix` rewrites), so that one deprecated later is caught too.
	if deprecated := *k.CheckDeprecatedFields(); len(deprecated) > 0 {
		t.Errorf("%s: uses fields kustomize v5 deprecates:\n%s", name, strings.Join(deprecated, "\n"))
	}
	return k
}

// TestKustomizeBuild renders each kustomization as `kustomize build` does and
// checks that the pieces fit: the workload runs pullproxy with the
// configuration the ConfigMap holds, probes what it listens on, keeps its data
// on the volume meant for it, and the Service, budget and ServiceMonitor find it.
func TestKustomizeBuild(t *testing.T) {
	example := configKeys(t, readFile(t, "pullproxy.example.yaml"))
	tests := []struct {
		dir   string
		kinds []string // of the output, sorted
	}{
		{"kubernetes/base", []string{"ConfigMap", "PodDisruptionBudget", "Service", "ServiceMonitor", "StatefulSet"}},
		{"kubernetes/overlays/daemonset", []string{"ConfigMap", "DaemonSet"}},
		{"kubernetes/overlays/replicated", []string{"ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount", "ServiceMonitor"}},
	}
	// Every kustomization is built here, the ones added later too.
	built := map[string]bool{}
	for _, tc := range tests {
		built[tc.dir] = true
	}
	err := filepath.WalkDir("kubernetes", func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Name() == "kustomization.yaml" && !built[filepath.ToSlash(filepath.Dir(p))] {
			t.Errorf("%s is not built here: add it to the table", filepath.Dir(p))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range tests {
		t.Run(tc.dir, func(t *testing.T) {
			m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), tc.dir)
			if err != nil {
				t.Fatal(err)
			}
			out, err := m.AsYaml()
			if err != nil {
				t.Fatal(err)
			}
			objs, err := decodeObjects(out)
			if err != nil {
				t.Fatal(err)
			}
			checkBuild(t, objs, tc.kinds, example)
		})
	}
}

type build struct {
	configMaps      map[string]*corev1.ConfigMap
	serviceAccounts map[string]*corev1.ServiceAccount
	services        []*corev1.Service
	pdbs            []*policyv1.PodDisruptionBudget
	monitors        []*serviceMonitor
	pod             *corev1.PodTemplateSpec
	claims          []corev1.PersistentVolumeClaim
	sts             *appsv1.StatefulSet
	ds              *appsv1.DaemonSet
	deploy          *appsv1.Deployment
}

func checkBuild(t *testing.T, objs []any, wantKinds []string, example map[string]bool) {
	b := build{configMaps: map[string]*corev1.ConfigMap{}, serviceAccounts: map[string]*corev1.ServiceAccount{}}
	var kinds []string
	for _, o := range objs {
		switch o := o.(type) {
		case *corev1.ConfigMap:
			kinds = append(kinds, "ConfigMap")
			b.configMaps[o.Name] = o
		case *corev1.Service:
			kinds = append(kinds, "Service")
			b.services = append(b.services, o)
		case *policyv1.PodDisruptionBudget:
			kinds = append(kinds, "PodDisruptionBudget")
			b.pdbs = append(b.pdbs, o)
		case *serviceMonitor:
			kinds = append(kinds, "ServiceMonitor")
			b.monitors = append(b.monitors, o)
		case *appsv1.StatefulSet:
			kinds = append(kinds, "StatefulSet")
			b.sts, b.pod, b.claims = o, &o.Spec.Template, o.Spec.VolumeClaimTemplates
		case *appsv1.DaemonSet:
			kinds = append(kinds, "DaemonSet")
			b.ds, b.pod = o, &o.Spec.Template
		case *appsv1.Deployment:
			kinds = append(kinds, "Deployment")
			b.deploy, b.pod = o, &o.Spec.Template
		case *corev1.ServiceAccount:
			kinds = append(kinds, "ServiceAccount")
			b.serviceAccounts[o.Name] = o
		default:
			t.Errorf("unexpected %T", o)
		}
	}
	slices.Sort(kinds)
	if !slices.Equal(kinds, wantKinds) {
		t.Fatalf("kinds %q, want %q", kinds, wantKinds)
	}

	spec := &b.pod.Spec
	c := container(t, spec.Containers, "pullproxy")
	if len(c.Args) == 0 || c.Args[0] != "serve" {
		t.Fatalf("args %q, want serve ...", c.Args)
	}
	cfg := podConfig(t, &b, c, example)

	// What pullproxy listens on, from its configuration or a flag over it.
	listen := cfg.Listen
	if l, ok := flagValue(c.Args[1:], "listen"); ok {
		listen = l
	}
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		t.Fatalf("listen %q: %v", listen, err)
	}
	var cport *corev1.ContainerPort
	for i := range c.Ports {
		if strconv.Itoa(int(c.Ports[i].ContainerPort)) == port {
			cport = &c.Ports[i]
		}
	}
	if cport == nil {
		t.Fatalf("listen %s: no container port %s", listen, port)
	}
	// The kubelet probes the pod's IP unless told otherwise; a listener on
	// one address only (loopback, with hostNetwork) must be probed there.
	probeHost := ""
	if ip := net.ParseIP(host); ip != nil && !ip.IsUnspecified() {
		probeHost = host
		if ip.IsLoopback() && !spec.HostNetwork {
			t.Errorf("listen %s: loopback inside the pod reaches no client", listen)
		}
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{
		{"liveness", c.LivenessProbe, "/healthz"},
		{"readiness", c.ReadinessProbe, "/readyz"},
		{"startup", c.StartupProbe, "/healthz"},
	} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s probe: want an HTTP GET of %s", p.name, p.path)
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path || !portIs(g.Port, cport) || g.Host != probeHost || (g.Scheme != "" && g.Scheme != corev1.URISchemeHTTP) {
			t.Errorf("%s probe: %s %s:%s%s, want http %s:%s%s", p.name, g.Scheme, g.Host, g.Port.String(), g.Path, probeHost, port, p.path)
		}
	}

	// Containers: non-root, read-only, no privilege to gain.
	sc := spec.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot {
		t.Error("pod securityContext: want runAsNonRoot")
	}
	if sc == nil || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Error("pod securityContext: want seccompProfile RuntimeDefault")
	}
	for _, k := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		s := k.SecurityContext
		if s == nil || s.ReadOnlyRootFilesystem == nil || !*s.ReadOnlyRootFilesystem ||
			s.AllowPrivilegeEscalation == nil || *s.AllowPrivilegeEscalation ||
			s.Capabilities == nil || !slices.Contains(s.Capabilities.Drop, "ALL") {
			t.Errorf("container %s: want readOnlyRootFilesystem, no allowPrivilegeEscalation, capabilities dropping ALL", k.Name)
		}
	}
	if s := c.SecurityContext; s != nil && (s.RunAsNonRoot != nil && !*s.RunAsNonRoot ||
		s.RunAsUser != nil && *s.RunAsUser == 0 || s.Capabilities != nil && len(s.Capabilities.Add) > 0) {
		t.Error("container pullproxy: runs as root or adds capabilities")
	}
	if g := spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second <= shutdownGrace {
		t.Errorf("terminationGracePeriodSeconds unset or at most %v: want more, pullproxy's own grace", shutdownGrace)
	}
	checkResources(t, c)

	// The pods' ServiceAccount is one the build makes (or the namespace's
	// default), and a ServiceAccount made is the pods'.
	if sa := spec.ServiceAccountName; sa != "" && sa != "default" && b.serviceAccounts[sa] == nil {
		t.Errorf("serviceAccountName %s: no such ServiceAccount in the build", sa)
	}
	for name := range b.serviceAccounts {
		if name != spec.ServiceAccountName {
			t.Errorf("ServiceAccount %s: the pods use %q", name, spec.ServiceAccountName)
		}
	}

	// The data dir is the volume kept for it, writable.
	dataDir := cfg.DataDir
	if d, ok := flagValue(c.Args[1:], "data-dir"); ok {
		dataDir = d
	}
	mount := mountAt(c, dataDir)
	if mount == nil || mount.ReadOnly {
		t.Fatalf("data_dir %s: no writable volume mounted there", dataDir)
	}
	switch {
	case b.sts != nil:
		i := slices.IndexFunc(b.claims, func(pvc corev1.PersistentVolumeClaim) bool { return pvc.Name == mount.Name })
		if i < 0 {
			t.Fatalf("data_dir %s: volume %s is not a volumeClaimTemplate", dataDir, mount.Name)
		}
		// A size bound must fit the claim, with room for the metadata.
		claim := b.claims[i].Spec.Resources.Requests[corev1.ResourceStorage]
		if size, err := parseSize(cfg.MaxSize); err == nil && size.Cmp(claim) >= 0 {
			t.Errorf("max_size %s: not below the claim's %s", cfg.MaxSize, claim.String())
		}
		if sc == nil || sc.FSGroup == nil {
			t.Error("pod securityContext: want fsGroup, so the claim is writable")
		}
		if b.sts.Spec.ServiceName != "" && !slices.ContainsFunc(b.services, func(s *corev1.Service) bool { return s.Name == b.sts.Spec.ServiceName }) {
			t.Errorf("serviceName %s: no such Service", b.sts.Spec.ServiceName)
		}
	case b.ds != nil:
		if v := volume(spec, mount.Name); v == nil || v.HostPath == nil {
			t.Errorf("data_dir %s: volume %s is not a hostPath", dataDir, mount.Name)
		}
		// Two pods on a node would share the data dir, which one process may use.
		if ru := b.ds.Spec.UpdateStrategy.RollingUpdate; ru != nil && ru.MaxSurge != nil && ru.MaxSurge.IntValue() != 0 {
			t.Errorf("updateStrategy maxSurge %s: want 0", ru.MaxSurge)
		}
	case b.deploy != nil:
		// Each replica's cache is its pod's own, bounded: the kubelet evicts
		// a pod whose emptyDir outgrows its sizeLimit, so max_size must be a
		// size below it, with room for the metadata.
		v := volume(spec, mount.Name)
		if v == nil || v.EmptyDir == nil || v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.IsZero() {
			t.Fatalf("data_dir %s: volume %s is not an emptyDir with a sizeLimit", dataDir, mount.Name)
		}
		limit := *v.EmptyDir.SizeLimit
		size, err := parseSize(cfg.MaxSize)
		switch {
		case err != nil:
			t.Errorf("max_size %q: want a size below the emptyDir's %s (%v)", cfg.MaxSize, limit.String(), err)
		case size.Cmp(limit) >= 0:
			t.Errorf("max_size %s: not below the emptyDir's %s", cfg.MaxSize, limit.String())
		}
		if req, ok := c.Resources.Requests[corev1.ResourceEphemeralStorage]; ok && req.Cmp(limit) < 0 {
			t.Errorf("ephemeral-storage request %s: below the emptyDir's %s", req.String(), limit.String())
		}
		// Replicas with caches that go with their pods are worth running
		// only in front of the bucket they share.
		if cfg.Storage.Type != "s3" {
			t.Errorf("storage.type %q: want s3, for replicas that share a bucket", cfg.Storage.Type)
		}
	}

	// The Service, budget and monitor select the pods and their ports.
	podLabels := labels.Set(b.pod.Labels)
	for _, s := range b.services {
		if len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(podLabels) {
			t.Errorf("Service %s: selector %v misses the pods %v", s.Name, s.Spec.Selector, podLabels)
		}
		for _, sp := range s.Spec.Ports {
			if !portIs(sp.TargetPort, cport) {
				t.Errorf("Service %s port %s: targets %s, not pullproxy's port", s.Name, sp.Name, sp.TargetPort.String())
			}
		}
	}
	for _, p := range b.pdbs {
		sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
		if err != nil || sel.Empty() || !sel.Matches(podLabels) {
			t.Errorf("PodDisruptionBudget %s: selector misses the pods (%v)", p.Name, err)
		}
		if p.Spec.MaxUnavailable == nil && p.Spec.MinAvailable == nil {
			t.Errorf("PodDisruptionBudget %s: no budget", p.Name)
		}
	}
	for _, m := range b.monitors {
		for _, e := range m.Spec.Endpoints {
			if e.Path != "/metrics" {
				t.Errorf("ServiceMonitor %s: path %q, want /metrics", m.Metadata.Name, e.Path)
			}
			if !slices.ContainsFunc(b.services, func(s *corev1.Service) bool {
				return labels.SelectorFromSet(m.Spec.Selector.MatchLabels).Matches(labels.Set(s.Labels)) &&
					slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == e.Port })
			}) {
				t.Errorf("ServiceMonitor %s: no selected Service has a port named %q", m.Metadata.Name, e.Port)
			}
		}
		if len(m.Spec.Endpoints) == 0 || len(m.Spec.Selector.MatchLabels) == 0 {
			t.Errorf("ServiceMonitor %s: no endpoints or no selector", m.Metadata.Name)
		}
	}
}

// pullproxyConfig holds the keys the manifests are checked against; the
// rest are compared with the example's keys only.
type pullproxyConfig struct {
	Listen  string `yaml:"listen"`
	DataDir string `yaml:"data_dir"`
	MaxSize string `yaml:"max_size"`
	Storage struct {
		Type string `yaml:"type"`
	} `yaml:"storage"`
}

// parseSize reads a max_size written as a size (180GiB) as a quantity; a
// percentage or off is an error.
func parseSize(s string) (resource.Quantity, error) {
	return resource.ParseQuantity(strings.TrimSuffix(s, "B"))
}

// podConfig finds the file --config names in the ConfigMap mounted for it,
// and checks its keys are ones pullproxy's example configuration has.
func podConfig(t *testing.T, b *build, c *corev1.Container, example map[string]bool) pullproxyConfig {
	t.Helper()
	file, ok := flagValue(c.Args[1:], "config")
	if !ok {
		t.Fatalf("args %q: no --config", c.Args)
	}
	mount := mountAt(c, path.Dir(file))
	if mount == nil {
		t.Fatalf("--config %s: nothing mounted at %s", file, path.Dir(file))
	}
	v := volume(&b.pod.Spec, mount.Name)
	if v == nil || v.ConfigMap == nil {
		t.Fatalf("--config %s: volume %s is not a ConfigMap", file, mount.Name)
	}
	cm := b.configMaps[v.ConfigMap.Name]
	if cm == nil {
		t.Fatalf("--config %s: no ConfigMap %s", file, v.ConfigMap.Name)
	}
	data, ok := cm.Data[path.Base(file)]
	if !ok {
		t.Fatalf("--config %s: ConfigMap %s has no key %s", file, cm.Name, path.Base(file))
	}
	for key := range configKeys(t, data) {
		if !example[key] {
			t.Errorf("config key %s is not in pullproxy.example.yaml", key)
		}
	}
	var cfg pullproxyConfig
	if err := yaml.Unmarshal([]byte(data), &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Listen == "" || cfg.DataDir == "" {
		t.Errorf("config: listen %q, data_dir %q: want both", cfg.Listen, cfg.DataDir)
	}
	return cfg
}

// configKeys lists the keys of a YAML document as paths: fetch.stall_timeout,
// upstreams[].endpoints[].url.
func configKeys(t *testing.T, data string) map[string]bool {
	t.Helper()
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(data), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		t.Fatal("configuration: want a mapping")
	}
	keys := map[string]bool{}
	var walk func(prefix string, n *yaml.Node)
	walk = func(prefix string, n *yaml.Node) {
		switch n.Kind {
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				k := n.Content[i].Value
				if prefix != "" {
					k = prefix + "." + k
				}
				keys[k] = true
				walk(k, n.Content[i+1])
			}
		case yaml.SequenceNode:
			for _, item := range n.Content {
				walk(prefix+"[]", item)
			}
		}
	}
	walk("", doc.Content[0])
	return keys
}

func checkResources(t *testing.T, c *corev1.Container) {
	t.Helper()
	req, lim := c.Resources.Requests, c.Resources.Limits
	if req.Cpu().IsZero() || req.Memory().IsZero() || lim.Memory().IsZero() {
		t.Fatalf("resources %v: want CPU and memory requests and a memory limit", c.Resources)
	}
	if lim.Memory().Cmp(*req.Memory()) < 0 {
		t.Errorf("memory limit %s below the request %s", lim.Memory(), req.Memory())
	}
	// GOMEMLIMIT must leave the kernel's limit unreached.
	for _, e := range c.Env {
		if e.Name != "GOMEMLIMIT" {
			continue
		}
		q, err := resource.ParseQuantity(strings.TrimSuffix(e.Value, "B"))
		if err != nil {
			t.Errorf("GOMEMLIMIT %q: %v", e.Value, err)
		} else if q.Cmp(*lim.Memory()) >= 0 {
			t.Errorf("GOMEMLIMIT %s: not below the memory limit %s", e.Value, lim.Memory())
		}
	}
}

func container(t *testing.T, cs []corev1.Container, name string) *corev1.Container {
	t.Helper()
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	t.Fatalf("no container %s", name)
	return nil
}

func mountAt(c *corev1.Container, dir string) *corev1.VolumeMount {
	for i := range c.VolumeMounts {
		if path.Clean(c.VolumeMounts[i].MountPath) == path.Clean(dir) {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}

func volume(spec *corev1.PodSpec, name string) *corev1.Volume {
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

// portIs reports whether p, a name or a number, is the container port cp.
func portIs(p intstr.IntOrString, cp *corev1.ContainerPort) bool {
	if p.Type == intstr.String {
		return cp.Name != "" && p.StrVal == cp.Name
	}
	return p.IntVal == cp.ContainerPort
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}
