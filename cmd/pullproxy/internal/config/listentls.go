package config

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// ListenTLS is the listener's TLS, off when CertFile is empty.
type ListenTLS struct {
	CertFile string `yaml:"cert_file"` // PEM certificate chain
	KeyFile  string `yaml:"key_file"`  // PEM private key
	// ClientCAFile, when set, requires every client to present a
	// certificate signed by one of these CAs.
	ClientCAFile string `yaml:"client_ca_file"`
}

// serverTLS returns the listener's TLS settings, or nil for plain HTTP.
func (c ListenTLS) ServerTLS(log *slog.Logger) (*tls.Config, error) {
	if c.CertFile == "" && c.KeyFile == "" && c.ClientCAFile == "" {
		return nil, nil
	}
	if c.CertFile == "" || c.KeyFile == "" {
		return nil, fmt.Errorf("tls: cert_file and key_file go together")
	}
	r := &certReloader{certFile: c.CertFile, keyFile: c.KeyFile, log: log}
	if err := r.load(); err != nil {
		return nil, fmt.Errorf("tls: %w", err)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: r.getCertificate}
	if c.ClientCAFile != "" {
		pem, err := os.ReadFile(c.ClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("tls: reading client_ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls: client_ca_file %s holds no PEM certificate", c.ClientCAFile)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// certReloader serves the listener's certificate and loads it again when
// its files change (a cert-manager renewal, a secret updated in place):
// at most once every certCheckEvery, on a handshake, it compares their
// modification times. A pair that does not load (half written) leaves the
// one in use, and is tried again at the next check.
type certReloader struct {
	certFile, keyFile string
	log               *slog.Logger

	cert      atomic.Pointer[tls.Certificate]
	checkedAt atomic.Int64 // unix nanoseconds
	loading   sync.Mutex
	certMod   time.Time // with loading: the files' times when last loaded
	keyMod    time.Time
}

const certCheckEvery = time.Second

func (r *certReloader) getCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	now := time.Now().UnixNano()
	if last := r.checkedAt.Load(); now-last >= int64(certCheckEvery) && r.checkedAt.CompareAndSwap(last, now) {
		r.reloadIfChanged()
	}
	return r.cert.Load(), nil
}

func (r *certReloader) reloadIfChanged() {
	if !r.loading.TryLock() {
		return
	}
	defer r.loading.Unlock()
	c, cerr := os.Stat(r.certFile)
	k, kerr := os.Stat(r.keyFile)
	if cerr != nil || kerr != nil || (c.ModTime().Equal(r.certMod) && k.ModTime().Equal(r.keyMod)) {
		return
	}
	if err := r.loadLocked(c.ModTime(), k.ModTime()); err != nil {
		r.log.Warn("listener certificate changed but does not load: still serving the previous one",
			"cert_file", r.certFile, "err", err, "fix", "check that the certificate and key files match and are complete")
		return
	}
	r.log.Info("listener certificate reloaded", "cert_file", r.certFile)
}

// load loads the pair the first time.
func (r *certReloader) load() error {
	r.loading.Lock()
	defer r.loading.Unlock()
	c, err := os.Stat(r.certFile)
	if err != nil {
		return err
	}
	k, err := os.Stat(r.keyFile)
	if err != nil {
		return err
	}
	return r.loadLocked(c.ModTime(), k.ModTime())
}

func (r *certReloader) loadLocked(certMod, keyMod time.Time) error {
	pair, err := tls.LoadX509KeyPair(r.certFile, r.keyFile)
	if err != nil {
		return err
	}
	r.cert.Store(&pair)
	r.certMod, r.keyMod = certMod, keyMod
	return nil
}
