package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"strings"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/doctor"
)

// doctorCommand runs `pullproxy doctor`: it walks the pull of an image step by
// step against its configured upstream, and says for each step whether it
// works, and if not, what kind of failure it is and the fix.
func doctorCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newMirrorCommand("doctor", "read the live state of the path (cut rates)",
		"usage: pullproxy doctor REF [--platform os/arch] [--json] [--config FILE] [--server ADDR]\n\n"+
			"Walks the pull of REF (docker.io/library/alpine:3.20) against its configured upstream: DNS, TCP,\n"+
			"TLS, the /v2/ challenge, credentials, the manifest, the platform, the config and every layer by\n"+
			"HEAD, the path's cuts and the local disk. Exit status: 0 it works; 1 something to fix here\n"+
			"(configuration, credentials, network, disk); 2 an upstream problem; 3 doctor could not run.\n\n", stderr)
	fs := c.flags
	platform := fs.String("platform", "linux/"+hostArch(), "the platform a node pulls")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := fs.Parse(args); err != nil {
		return &exitError{code: doctor.CannotRun, err: err}
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return &exitError{code: doctor.CannotRun, err: errors.New("doctor: want one image reference")}
	}
	cfg, err := c.config()
	if err != nil {
		return &exitError{code: doctor.CannotRun, err: err}
	}
	server, serverErr := doctorAdmin(c.admin, cfg)
	steps := doctor.Diagnose(ctx, cfg, fs.Arg(0), doctor.Options{Platform: *platform, Server: server, ServerErr: serverErr})
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(steps)
	} else {
		doctor.WriteText(stdout, steps)
	}
	if code := doctor.ExitCode(steps); code != 0 {
		return &exitError{code: code}
	}
	return nil
}

// doctorAdmin returns the admin endpoint doctor reads the path's live
// state from: --server, or the socket of a server running on the data
// dir; nil when there is none. The error says why the endpoint named
// cannot be called.
func doctorAdmin(endpoint admin.Flags, cfg config.File) (*admin.Target, error) {
	if endpoint.Server == "" {
		path, ok := strings.CutPrefix(cfg.AdminAddress(), "unix:")
		if fi, err := os.Lstat(path); !ok || err != nil || fi.Mode()&os.ModeSocket == 0 {
			return nil, nil
		}
	}
	t, err := endpoint.Target(cfg)
	if err != nil {
		return nil, err
	}
	return &t, nil
}
