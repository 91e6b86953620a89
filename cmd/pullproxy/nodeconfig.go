package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/distribution/reference"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/upstream"
)

// registryFlags collects repeated --registry flags.
type registryFlags []string

func (f *registryFlags) String() string { return strings.Join(*f, ",") }
func (f *registryFlags) Set(v string) error {
	for r := range strings.SplitSeq(v, ",") {
		if r = strings.TrimSpace(r); r != "" {
			*f = append(*f, r)
		}
	}
	return nil
}

// nodeConfig runs `pullproxy node-config`: it writes what a node's
// containerd (hosts.toml per registry) or CRI-O (registries.conf) needs to
// pull through the mirror, and says how to enable it.
func nodeConfig(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("node-config", flag.ContinueOnError)
	fs.SetOutput(stderr)
	mirror := fs.String("mirror", "", "the mirror's URL, as nodes reach it (http://pullproxy.internal:5000)")
	var registries registryFlags
	fs.Var(&registries, "registry", "a registry to pull through the mirror: NAME (reached by https), http://NAME (plain HTTP) or https://NAME; NAME is a host, optionally with :PORT (repeatable, or comma-separated; default: the public registries pullproxy mirrors)")
	noFallback := fs.Bool("no-fallback", false, "never pull from the registry itself when the mirror fails (an air-gapped site)")
	dir := fs.String("dir", "/etc/containerd/certs.d", "containerd's config_path: one directory per registry")
	crio := fs.Bool("crio", false, "write CRI-O's (and podman's) registries.conf instead")
	crioFile := fs.String("crio-file", "/etc/containers/registries.conf.d/pullproxy.conf", "with --crio: the file to write")
	dryRun := fs.Bool("dry-run", false, "print what would be written, write nothing")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy node-config --mirror URL [--registry [http://]NAME...] [--no-fallback]\n"+
			"                             [--dir DIR | --crio [--crio-file FILE]] [--dry-run]\n\n"+
			"Writes containerd's hosts.toml for each registry (the mirror first, the registry itself as the\n"+
			"fallback unless --no-fallback), or CRI-O's registries.conf with --crio, and prints the lines\n"+
			"that enable them. The fallback reaches a registry by https unless it is given as http://NAME.\n"+
			"CRI-O's mirror location names a registry with a port as HOST_PORT (pullproxy:5000/registry.internal_5000):\n"+
			"a repository path cannot hold a colon.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("node-config: unexpected argument %q", fs.Arg(0))
	}
	m, err := url.Parse(*mirror)
	if err != nil || (m.Scheme != "http" && m.Scheme != "https") || m.Host == "" || strings.Trim(m.Path, "/") != "" {
		return fmt.Errorf("node-config: --mirror %q: want the mirror's base URL, e.g. http://pullproxy.internal:5000", *mirror)
	}
	if len(registries) == 0 {
		for _, d := range upstream.Defaults() {
			registries = append(registries, d.Name)
		}
	}
	var regs []nodeRegistry
	for _, v := range registries {
		r, err := parseRegistry(v)
		if err == nil && *crio && strings.HasPrefix(r.name, "[") {
			err = errors.New("CRI-O's mirror location cannot name an IPv6 address; use a host name")
		}
		if err != nil {
			return fmt.Errorf("node-config: --registry %q: %w", v, err)
		}
		regs = append(regs, r)
	}
	files := map[string]string{}
	var order []string
	if *crio {
		files[*crioFile], order = crioRegistries(m, regs, *noFallback), []string{*crioFile}
	} else {
		for _, r := range regs {
			path := filepath.Join(*dir, r.name, "hosts.toml")
			files[path] = hostsTOML(m, r, *noFallback)
			order = append(order, path)
		}
	}
	for _, path := range order {
		if *dryRun {
			fmt.Fprintf(stdout, "# %s\n%s\n", path, files[path])
			continue
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return fmt.Errorf("node-config: %w", err)
		}
		if err := fsutil.WriteFile(path, []byte(files[path])); err != nil {
			return fmt.Errorf("node-config: %w", err)
		}
		fmt.Fprintf(stderr, "wrote %s\n", path)
	}
	if *crio {
		fmt.Fprintln(stdout, "# CRI-O reads registries.conf.d at start: systemctl restart crio")
		return nil
	}
	fmt.Fprintf(stdout, "# Enable the directory in /etc/containerd/config.toml, then restart containerd:\n"+
		"#   containerd 1.x:\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = %q\n"+
		"#   containerd 2.x:\n[plugins.\"io.containerd.cri.v1.images\".registry]\n  config_path = %q\n", *dir, *dir)
	return nil
}

// nodeRegistry is a registry a node pulls through the mirror.
type nodeRegistry struct {
	name   string // host[:port], canonical: containerd's directory, CRI-O's prefix
	scheme string // how the registry itself is reached: "https" or "http"
}

// registryHostPattern is a registry host, optionally with a port, as an
// image reference spells it.
var registryHostPattern = regexp.MustCompile(`^(?:` + reference.DomainRegexp.String() + `)$`)

// parseRegistry reads a --registry value: NAME, http://NAME or https://NAME,
// NAME being a host, optionally with a port. The scheme says how the node
// reaches the registry itself, when it falls back to it.
func parseRegistry(v string) (nodeRegistry, error) {
	r := nodeRegistry{name: v, scheme: "https"}
	if strings.Contains(v, "://") {
		u, err := url.Parse(v)
		switch {
		case err != nil:
			return r, fmt.Errorf("not a URL: %w", err)
		case u.Scheme != "http" && u.Scheme != "https":
			return r, fmt.Errorf("scheme %s: want http:// or https://", u.Scheme)
		case u.User != nil:
			return r, errors.New("has credentials: they belong in the node's own auth config")
		case strings.Trim(u.Path, "/") != "" || u.RawPath != "":
			return r, errors.New("has a path: want a registry host, e.g. http://registry.internal:5000")
		case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
			return r, errors.New("has a query or fragment: want a registry host, e.g. http://registry.internal:5000")
		}
		r.name, r.scheme = u.Host, u.Scheme
	}
	if !registryHostPattern.MatchString(r.name) {
		return r, errors.New("want a registry host, optionally with :PORT and http:// or https://, e.g. docker.io or http://registry.internal:5000")
	}
	r.name = upstream.CanonicalName(r.name)
	if r.name == upstream.DockerHub && r.scheme == "http" {
		return r, errors.New("docker.io is served over https only")
	}
	return r, nil
}

// host is where a node reaches the registry itself: Docker Hub's API is
// not at docker.io.
func (r nodeRegistry) host() string {
	if r.name == upstream.DockerHub {
		return "registry-1.docker.io"
	}
	return r.name
}

// server is the URL a node reaches the registry itself at.
func (r nodeRegistry) server() string { return r.scheme + "://" + r.host() }

// mirrorPrefix is the registry's name as the first path component of its
// mirror location: HOST_PORT for HOST:PORT, as a repository path cannot
// hold a colon (podman refuses the reference). pullproxy routes either form.
func (r nodeRegistry) mirrorPrefix() string {
	if i := strings.LastIndexByte(r.name, ':'); i >= 0 {
		return r.name[:i] + "_" + r.name[i+1:]
	}
	return r.name
}

// hostsTOML is containerd's hosts.toml for registry: the mirror first,
// then the registry itself. containerd always appends the registry as its
// last host; without fallback it is given only the push capability, so
// that no pull or resolve goes to it.
func hostsTOML(mirror *url.URL, registry nodeRegistry, noFallback bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s through pullproxy; written by pullproxy node-config.\n", registry.name)
	fmt.Fprintf(&b, "# containerd adds ?ns=%s to each request to the mirror, so pullproxy knows the upstream.\n", registry.name)
	fmt.Fprintf(&b, "server = %q\n", registry.server())
	if noFallback {
		b.WriteString("# No fallback: the registry itself is never asked for a pull.\ncapabilities = [\"push\"]\n")
	}
	fmt.Fprintf(&b, "\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", mirror.String())
	return b.String()
}

// crioRegistries is a registries.conf drop-in: each registry's mirror is
// the mirror with the registry's name (HOST_PORT for a port) as the first
// path component, as pullproxy routes requests that carry no ns.
// insecure lets CRI-O and podman speak plain HTTP to a location.
func crioRegistries(mirror *url.URL, registries []nodeRegistry, noFallback bool) string {
	var b strings.Builder
	b.WriteString("# CRI-O and podman through pullproxy; written by pullproxy node-config.\n")
	b.WriteString("# The mirror's path names the registry; a port is written _PORT, as a path cannot hold a colon.\n")
	mirrorInsecure := mirror.Scheme == "http"
	for _, r := range registries {
		through := mirror.Host + "/" + r.mirrorPrefix()
		if noFallback {
			// CRI-O pulls from location once every mirror failed: there,
			// location is the mirror too.
			fmt.Fprintf(&b, "\n[[registry]]\nprefix = %q\nlocation = %q\ninsecure = %v\n", r.name, through, mirrorInsecure)
			continue
		}
		fmt.Fprintf(&b, "\n[[registry]]\nprefix = %q\nlocation = %q\ninsecure = %v\n", r.name, r.host(), r.scheme == "http")
		fmt.Fprintf(&b, "\n[[registry.mirror]]\nlocation = %q\ninsecure = %v\n", through, mirrorInsecure)
	}
	return b.String()
}
