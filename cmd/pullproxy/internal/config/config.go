// Package config is pullproxy's configuration: the YAML file, its
// defaults and validation, the flags the commands share and how they
// override the file, and the listener's TLS. The other packages of the
// command take what they need from a File; proxy, storage and upstream
// never see YAML.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/proxy"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/upstream"
)

// File is the YAML configuration file. Every field is optional; the
// README documents it with an example.
type File struct {
	Listen          string         `yaml:"listen"`
	DataDir         string         `yaml:"data_dir"`
	LogLevel        string         `yaml:"log_level"`
	LogFormat       string         `yaml:"log_format"`
	TagTTL          *time.Duration `yaml:"tag_ttl"`
	NotFoundTTL     *time.Duration `yaml:"not_found_ttl"` // how long an upstream's 404 is answered from memory
	FetchTimeout    *time.Duration `yaml:"fetch_timeout"`
	SendTimeout     *time.Duration `yaml:"send_timeout"`           // a client taking no bytes of a blob for this long is dropped
	MaxClientConns  int            `yaml:"max_client_connections"` // 0: from the descriptor limit
	AllowClients    []string       `yaml:"allow_clients"`          // addresses and networks that may connect; empty: any
	TLS             ListenTLS      `yaml:"tls"`                    // the listener's; off without cert_file
	DefaultUpstream string         `yaml:"default_upstream"`
	BlobLoop        *bool          `yaml:"blob_loop"`
	ScrubRate       *ByteSize      `yaml:"scrub_rate"`     // bytes/s the background re-hashing reads; 0: off
	ScrubInterval   *time.Duration `yaml:"scrub_interval"` // from one scrub pass's start to the next's
	Offline         bool           `yaml:"offline"`        // never contact an upstream: serve what the store holds
	AdminListen     string         `yaml:"admin_listen"`   // seeds and imports into the running server: unix:/path, a loopback host:port, or off; default unix:DATA_DIR/admin.sock
	MaxSize         StoreBound     `yaml:"max_size"`       // a size, a percentage of the file system, or off; default 85%
	Pin             []string       `yaml:"pin"`            // images never evicted
	Fetch           Fetch          `yaml:"fetch"`
	Storage         Storage        `yaml:"storage"` // type s3: replicas sharing a bucket
	Upstreams       []Upstream     `yaml:"upstreams"`
	Sync            []SyncRule     `yaml:"sync"` // images kept cached before anyone asks

	// AdminTokenFile holds the bearer token a TCP admin_listen requires;
	// default DATA_DIR/admin.token, created mode 0600.
	AdminTokenFile string `yaml:"admin_token_file"`

	// CPUProfile is a file to write a CPU profile of the whole run to: a
	// flag only, for finding where a benchmark's CPU goes.
	CPUProfile string `yaml:"-"`
}

// Fetch tunes blob fetching; zero values take upstream.FetchConfig's defaults.
type Fetch struct {
	ConnectionBudget    ByteSize      `yaml:"connection_budget"`
	MaxConnectionBudget ByteSize      `yaml:"max_connection_budget"`
	MinConnectionBudget ByteSize      `yaml:"min_connection_budget"`
	ParallelChunks      int           `yaml:"parallel_chunks"`
	MaxConnections      int           `yaml:"max_connections"`
	StallTimeout        time.Duration `yaml:"stall_timeout"`
	FirstByteTimeout    time.Duration `yaml:"first_byte_timeout"`
	MaxAttempts         int           `yaml:"max_attempts"`
	MinGoodput          ByteSize      `yaml:"min_goodput"` // per second; -1: none
	BackgroundShare     float64       `yaml:"background_share"`
}

// Options is the fetch tuning as upstream takes it.
func (f Fetch) Options() upstream.FetchConfig {
	return upstream.FetchConfig{
		ConnectionBudget:    int64(f.ConnectionBudget),
		MaxConnectionBudget: int64(f.MaxConnectionBudget),
		MinConnectionBudget: int64(f.MinConnectionBudget),
		ParallelChunks:      f.ParallelChunks,
		MaxConnections:      f.MaxConnections,
		StallTimeout:        f.StallTimeout,
		FirstByteTimeout:    f.FirstByteTimeout,
		MaxAttempts:         f.MaxAttempts,
		MinGoodput:          int64(f.MinGoodput),
		BackgroundShare:     f.BackgroundShare,
	}
}

// Storage says where blobs and metadata are shared. The local data
// dir is always used: alone (type local, the default), or as each
// replica's cache in front of a bucket the replicas share (type s3).
type Storage struct {
	Type         string        `yaml:"type"` // local | s3
	Bucket       string        `yaml:"bucket"`
	Endpoint     string        `yaml:"endpoint"` // an S3-compatible server (MinIO, Ceph RGW); empty: AWS S3
	Region       string        `yaml:"region"`
	Prefix       string        `yaml:"prefix"`
	PathStyle    bool          `yaml:"path_style"`
	Serve        string        `yaml:"serve"`         // cache: through the replica; redirect: presigned URLs to the bucket
	LeaseTTL     time.Duration `yaml:"lease_ttl"`     // a download whose replica stops renewing its lease this long is taken over
	PartSize     ByteSize      `yaml:"part_size"`     // uploads go up in parts of this size
	StaleUploads time.Duration `yaml:"stale_uploads"` // uploads untouched this long are removed
}

// Shared tells whether replicas share a bucket.
func (c Storage) Shared() bool { return c.Type == "s3" }

// BucketConfig is the shared bucket's settings, as bucket takes them.
func (c Storage) BucketConfig() bucket.Config {
	return bucket.Config{Bucket: c.Bucket, Endpoint: c.Endpoint, Region: c.Region, Prefix: c.Prefix,
		PathStyle: c.PathStyle, Redirect: c.Serve == "redirect", LeaseTTL: c.LeaseTTL,
		PartSize: int64(c.PartSize), StaleUploads: c.StaleUploads}
}

func (c Storage) validate() error {
	switch c.Type {
	case "", "local":
		if c.Bucket != "" {
			return errors.New("storage: a bucket is named but type is not s3")
		}
		return nil
	case "s3":
	default:
		return fmt.Errorf("storage: type %q: want local or s3", c.Type)
	}
	var errs []error
	if c.Bucket == "" {
		errs = append(errs, errors.New("storage: type s3 needs a bucket"))
	}
	if c.Serve != "" && c.Serve != "cache" && c.Serve != "redirect" {
		errs = append(errs, fmt.Errorf("storage: serve %q: want cache or redirect", c.Serve))
	}
	if c.PartSize != 0 && (c.PartSize < 5<<20 || c.PartSize > 5<<30) {
		errs = append(errs, fmt.Errorf("storage: part_size %d is outside S3's 5MiB to 5GiB", c.PartSize))
	}
	if c.LeaseTTL < 0 || c.StaleUploads < 0 {
		errs = append(errs, errors.New("storage: lease_ttl and stale_uploads must not be negative"))
	}
	if c.Endpoint != "" {
		if u, err := url.Parse(c.Endpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("storage: endpoint %q: want http(s)://host[:port]", c.Endpoint))
		}
	}
	return errors.Join(errs...)
}

// ByteSize is a size in bytes, written as a number or with a unit: 1MiB,
// 64MiB, 512KiB, 1MB.
type ByteSize int64

func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	v, err := ParseByteSize(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: %w", n.Line, err)
	}
	*b = ByteSize(v)
	return nil
}

// ParseByteSize reads a size: a number of bytes, optionally with KiB,
// MiB, GiB, KB, MB or GB; "-1" is returned as -1 (none).
func ParseByteSize(s string) (int64, error) {
	if strings.TrimSpace(s) == "-1" {
		return -1, nil // "none", where a setting takes it; refused elsewhere
	}
	units := []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"B", 1}}
	num, mult := strings.TrimSpace(s), int64(1)
	for _, u := range units {
		if v, ok := strings.CutSuffix(num, u.suffix); ok {
			num, mult = strings.TrimSpace(v), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("size %q: want a number of bytes, optionally with KiB, MiB, GiB, KB, MB or GB", s)
	}
	return n * mult, nil
}

// Default is what pullproxy runs with when nothing is configured.
func Default() File {
	ttl, notFoundTTL, timeout, sendTimeout, loop := 5*time.Minute, 5*time.Second, time.Hour, time.Minute, true
	scrubRate, scrubInterval := ByteSize(16<<20), 24*time.Hour
	return File{
		Listen:        "127.0.0.1:5000",
		DataDir:       "./data",
		LogLevel:      "info",
		LogFormat:     "text",
		TagTTL:        &ttl,
		NotFoundTTL:   &notFoundTTL,
		FetchTimeout:  &timeout,
		SendTimeout:   &sendTimeout,
		BlobLoop:      &loop,
		ScrubRate:     &scrubRate,
		ScrubInterval: &scrubInterval,
	}
}

// LoadFile reads path over cfg. Unknown keys are errors: a misspelt key
// silently ignored is a mirror silently misconfigured.
func LoadFile(path string, cfg *File) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(cfg); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("config %s: %w", path, err)
	}
	return nil
}

// Validate checks the configuration as a whole: every error found, joined.
func (c *File) Validate() error {
	var errs []error
	seen := map[string]bool{}
	for i, u := range c.Upstreams {
		name := upstream.CanonicalName(u.Name)
		switch {
		case u.Name == "":
			errs = append(errs, fmt.Errorf("upstreams[%d]: no name", i))
		case seen[name]:
			errs = append(errs, fmt.Errorf("upstreams[%d]: %s is configured twice", i, u.Name))
		case len(u.Endpoints) == 0 && !u.Offline && !c.Offline:
			errs = append(errs, fmt.Errorf("upstream %s: no endpoints (an upstream served only from the store says offline: true)", u.Name))
		}
		if u.Auth.Type == "ecr" {
			for _, e := range u.Endpoints {
				if e.Region == "" && upstream.ECRRegion(hostOf(e.URL)) == "" {
					errs = append(errs, fmt.Errorf("upstream %s: endpoint %s is not an ECR host: give its region", u.Name, e.URL))
				}
			}
		}
		seen[name] = true
	}
	if _, err := proxy.ParseClientList(c.AllowClients); err != nil {
		errs = append(errs, fmt.Errorf("allow_clients: %w", err))
	}
	for _, u := range c.Upstreams {
		if _, err := proxy.ParseClientList(u.AllowClients); err != nil {
			errs = append(errs, fmt.Errorf("upstream %s: allow_clients: %w", u.Name, err))
		}
	}
	if c.MaxClientConns < 0 {
		errs = append(errs, fmt.Errorf("max_client_connections %d: want 0 (from the descriptor limit) or more", c.MaxClientConns))
	}
	if (c.ScrubRate != nil && *c.ScrubRate < 0) || (c.ScrubInterval != nil && *c.ScrubInterval <= 0) {
		errs = append(errs, fmt.Errorf("scrub_rate must be 0 (off) or more, and scrub_interval more than 0"))
	}
	for _, pin := range c.Pin {
		if p, err := imageref.Parse(pin); err != nil {
			errs = append(errs, err)
		} else if !seen[p.Upstream] {
			errs = append(errs, fmt.Errorf("pin %q: %s is not among the upstreams", pin, p.Upstream))
		}
	}
	if c.DefaultUpstream != "" && !seen[upstream.CanonicalName(c.DefaultUpstream)] {
		errs = append(errs, fmt.Errorf("default_upstream %s is not among the upstreams", c.DefaultUpstream))
	}
	if c.TagTTL != nil && *c.TagTTL < 0 {
		errs = append(errs, fmt.Errorf("tag_ttl %v is negative", *c.TagTTL))
	}
	if err := c.Storage.validate(); err != nil {
		errs = append(errs, err)
	}
	if c.FetchTimeout != nil && *c.FetchTimeout <= 0 {
		errs = append(errs, fmt.Errorf("fetch_timeout %v is not positive", *c.FetchTimeout))
	}
	if s := c.Fetch.BackgroundShare; s != 0 && !(s > 0 && s <= 1) {
		errs = append(errs, fmt.Errorf("fetch: background_share %v is not in (0, 1]", s))
	}
	errs = append(errs, c.validateSync(seen)...)
	return errors.Join(errs...)
}

// hostOf is rawURL's host[:port], or "".
func hostOf(rawURL string) string {
	if u, err := url.Parse(rawURL); err == nil {
		return u.Host
	}
	return ""
}

// Upstream returns the configured upstream of canonical name name, or nil.
func (c *File) Upstream(name string) *Upstream {
	for i := range c.Upstreams {
		if upstream.CanonicalName(c.Upstreams[i].Name) == name {
			return &c.Upstreams[i]
		}
	}
	return nil
}

// adminSocketName is the default socket's name in the data dir.
const adminSocketName = "admin.sock"

// adminTokenName is the default token file's name in the data dir.
const adminTokenName = "admin.token"

// AdminAddress returns where the admin endpoint listens: "off",
// "unix:/path", or a TCP host:port; by default the socket in the data dir.
func (c File) AdminAddress() string {
	if c.AdminListen == "" {
		return "unix:" + filepath.Join(c.DataDir, adminSocketName)
	}
	return c.AdminListen
}

// AdminTokenPath returns the file holding the admin endpoint's token; by
// default in the data dir.
func (c File) AdminTokenPath() string {
	if c.AdminTokenFile != "" {
		return c.AdminTokenFile
	}
	return filepath.Join(c.DataDir, adminTokenName)
}
