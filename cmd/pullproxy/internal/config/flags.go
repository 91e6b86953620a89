package config

import (
	"flag"
)

// UpstreamFlags collects repeated --upstream flags.
type UpstreamFlags []Upstream

func (f *UpstreamFlags) String() string { return "" }
func (f *UpstreamFlags) Set(v string) error {
	u, err := parseUpstreamFlag(v)
	if err != nil {
		return err
	}
	*f = append(*f, u)
	return nil
}

// CommandFlags are the flags the commands besides serve share: where the
// data dir and the upstreams are.
type CommandFlags struct {
	dataDir, configPath string
	ups                 UpstreamFlags
}

// Register adds the flags to fs.
func (a *CommandFlags) Register(fs *flag.FlagSet) {
	fs.StringVar(&a.dataDir, "data-dir", "", "the data dir; when a server runs on it, through its admin endpoint (default: the config's, or ./data)")
	fs.StringVar(&a.configPath, "config", "", "YAML configuration file: upstreams, credentials, data_dir")
	fs.Var(&a.ups, "upstream", "NAME=URL[,URL...]: an upstream, as for serve (repeatable)")
}

// Load reads the configuration: defaults, then the file, then the flags;
// validated.
func (a *CommandFlags) Load() (File, error) {
	cfg := Default()
	if a.configPath != "" {
		if err := LoadFile(a.configPath, &cfg); err != nil {
			return cfg, err
		}
	}
	if a.dataDir != "" {
		cfg.DataDir = a.dataDir
	}
	cfg.Upstreams = WithDefaultUpstreams(MergeUpstreams(cfg.Upstreams, a.ups))
	return cfg, cfg.Validate()
}
