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

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/nodeconfig"
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
	var regs []nodeconfig.Registry
	for _, v := range registries {
		r, err := nodeconfig.ParseRegistry(v)
		if err == nil && *crio && strings.HasPrefix(r.Name, "[") {
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
		files[*crioFile], order = nodeconfig.CRIORegistries(m, regs, *noFallback), []string{*crioFile}
	} else {
		for _, r := range regs {
			path := filepath.Join(*dir, r.Name, "hosts.toml")
			files[path] = nodeconfig.HostsTOML(m, r, *noFallback)
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
