package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"

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
	fs.Var(&registries, "registry", "a registry to pull through the mirror (repeatable, or comma-separated; default: the public registries pullproxy mirrors)")
	noFallback := fs.Bool("no-fallback", false, "never pull from the registry itself when the mirror fails (an air-gapped site)")
	dir := fs.String("dir", "/etc/containerd/certs.d", "containerd's config_path: one directory per registry")
	crio := fs.Bool("crio", false, "write CRI-O's (and podman's) registries.conf instead")
	crioFile := fs.String("crio-file", "/etc/containers/registries.conf.d/pullproxy.conf", "with --crio: the file to write")
	dryRun := fs.Bool("dry-run", false, "print what would be written, write nothing")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy node-config --mirror URL [--registry NAME...] [--no-fallback] [--dir DIR] [--crio] [--dry-run]\n\n"+
			"Writes containerd's hosts.toml for each registry (the mirror first, the registry itself as the\n"+
			"fallback unless --no-fallback), or CRI-O's registries.conf with --crio, and prints the lines\n"+
			"that enable them.\n\n")
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
	for i, r := range registries {
		if strings.ContainsAny(r, "/\\ ") || r == "." || r == ".." {
			return fmt.Errorf("node-config: --registry %q: want a registry host, e.g. docker.io or registry.internal:5000", r)
		}
		registries[i] = upstream.CanonicalName(r)
	}
	files := map[string]string{}
	var order []string
	if *crio {
		files[*crioFile], order = crioRegistries(m, registries, *noFallback), []string{*crioFile}
	} else {
		for _, r := range registries {
			path := filepath.Join(*dir, r, "hosts.toml")
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
		if err := writeFileAtomic(path, []byte(files[path])); err != nil {
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

// registryServer is the URL containerd uses for a registry itself.
func registryServer(name string) string {
	if name == "docker.io" {
		return "https://registry-1.docker.io"
	}
	return "https://" + name
}

// hostsTOML is containerd's hosts.toml for registry: the mirror first,
// then the registry itself. containerd always appends the registry as its
// last host; without fallback it is given only the push capability, so
// that no pull or resolve goes to it.
func hostsTOML(mirror *url.URL, registry string, noFallback bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s through pullproxy; written by pullproxy node-config.\n", registry)
	fmt.Fprintf(&b, "# containerd adds ?ns=%s to each request to the mirror, so pullproxy knows the upstream.\n", registry)
	fmt.Fprintf(&b, "server = %q\n", registryServer(registry))
	if noFallback {
		b.WriteString("# No fallback: the registry itself is never asked for a pull.\ncapabilities = [\"push\"]\n")
	}
	fmt.Fprintf(&b, "\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", mirror.String())
	return b.String()
}

// crioRegistries is a registries.conf drop-in: each registry's mirror is
// the mirror with the registry's name as the first path component, as
// pullproxy routes requests that carry no ns.
func crioRegistries(mirror *url.URL, registries []string, noFallback bool) string {
	var b strings.Builder
	b.WriteString("# CRI-O and podman through pullproxy; written by pullproxy node-config.\n")
	insecure := mirror.Scheme == "http"
	for _, r := range registries {
		through := mirror.Host + "/" + r
		location := r
		if r == "docker.io" {
			location = "registry-1.docker.io"
		}
		if noFallback {
			// CRI-O pulls from location once every mirror failed: there,
			// location is the mirror too.
			fmt.Fprintf(&b, "\n[[registry]]\nprefix = %q\nlocation = %q\ninsecure = %v\n", r, through, insecure)
			continue
		}
		fmt.Fprintf(&b, "\n[[registry]]\nprefix = %q\nlocation = %q\n", r, location)
		fmt.Fprintf(&b, "\n[[registry.mirror]]\nlocation = %q\ninsecure = %v\n", through, insecure)
	}
	return b.String()
}

// writeFileAtomic replaces path with b: a reader never sees half a file.
func writeFileAtomic(path string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".pullproxy-*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(b)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return errors.Join(fmt.Errorf("writing %s", path), err)
	}
	return nil
}
