package config

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// testCA issues certificates for the listener's TLS tests.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
	pem  []byte
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "pullproxy test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testCA{cert: cert, key: key, pool: pool, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue writes a certificate with serial for 127.0.0.1 (a server's, or a
// client's) and its key as PEM files, and returns them as a pair too.
func (ca *testCA) issue(t *testing.T, certFile, keyFile string, serial int64, usage x509.ExtKeyUsage) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
	// Key first: the reloader looks when either file changes, and takes
	// the pair once both load.
	if err := os.WriteFile(keyFile, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certFile, certPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return pair
}

// TestListenerTLS: the listener serves HTTPS with the configured certificate,
// requires client certificates signed by the configured CA, and serves a
// renewed certificate once its files change, without a restart.
func TestListenerTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca := newTestCA(t)
	certFile, keyFile, caFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "clients.pem")
	ca.issue(t, certFile, keyFile, 100, x509.ExtKeyUsageServerAuth)
	client := ca.issue(t, filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key"), 200, x509.ExtKeyUsageClientAuth)
	if err := os.WriteFile(caFile, ca.pem, 0o644); err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(config, []byte("tls:\n  cert_file: "+certFile+"\n  key_file: "+keyFile+"\n  client_ca_file: "+caFile+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := Default()
	if err := LoadFile(config, &cfg); err != nil {
		t.Fatal(err)
	}
	serverTLS, err := cfg.TLS.ServerTLS(slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}), ReadHeaderTimeout: 10 * time.Second}
	go hs.Serve(tls.NewListener(ln, serverTLS))
	t.Cleanup(func() { hs.Close() })
	url := "https://" + ln.Addr().String() + "/v2/"

	get := func(certs ...tls.Certificate) (*http.Response, error) {
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.pool, Certificates: certs}}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get(url)
		if err == nil {
			resp.Body.Close()
		}
		return resp, err
	}
	resp, err := get(client)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("with a client certificate: %v, %v", resp, err)
	}
	if got := resp.TLS.PeerCertificates[0].SerialNumber.Int64(); got != 100 {
		t.Errorf("served certificate %d, want 100", got)
	}
	if _, err := get(); err == nil {
		t.Error("without a client certificate: got an answer, want the handshake refused")
	}

	ca.issue(t, certFile, keyFile, 101, x509.ExtKeyUsageServerAuth) // renewed in place
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := get(client)
		if err == nil && resp.TLS.PeerCertificates[0].SerialNumber.Int64() == 101 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the renewed certificate is not served within 10 s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
