package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// syncedUpstream wraps a registry to see what a sync asks of it, and to
// answer as a rate-limiting registry does when told to.
type syncedUpstream struct {
	next http.Handler

	mu        sync.Mutex
	paths     []string // "METHOD path", in order
	tagPage   int      // > 0: tag lists and the catalog are asked for in pages of this many
	throttle  int      // answer this many more tag lists 429, with Retry-After
	retryWait int      // the Retry-After sent, in seconds
	pullsLeft int      // > 0: manifests carry Docker Hub's rate-limit headers, this many left of 100
}

func (u *syncedUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.paths = append(u.paths, r.Method+" "+r.URL.Path)
	tagList := strings.HasSuffix(r.URL.Path, "/tags/list")
	throttled := tagList && u.throttle > 0
	if throttled {
		u.throttle--
	}
	if (tagList || r.URL.Path == "/v2/_catalog") && u.tagPage > 0 {
		q := r.URL.Query()
		if n, _ := strconv.Atoi(q.Get("n")); n == 0 || n > u.tagPage {
			q.Set("n", strconv.Itoa(u.tagPage))
			r.URL.RawQuery = q.Encode()
		}
	}
	if left := u.pullsLeft; left > 0 && strings.Contains(r.URL.Path, "/manifests/") {
		w.Header().Set("RateLimit-Limit", "100;w=21600")
		w.Header().Set("RateLimit-Remaining", fmt.Sprintf("%d;w=21600", left))
	}
	retryWait := u.retryWait
	u.mu.Unlock()
	if throttled {
		w.Header().Set("Retry-After", strconv.Itoa(retryWait))
		http.Error(w, `{"errors":[{"code":"TOOMANYREQUESTS","message":"slow down"}]}`, http.StatusTooManyRequests)
		return
	}
	u.next.ServeHTTP(w, r)
}

// asked returns the requests since the last call.
func (u *syncedUpstream) asked() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	p := u.paths
	u.paths = nil
	return p
}

func (u *syncedUpstream) set(f func(u *syncedUpstream)) {
	u.mu.Lock()
	defer u.mu.Unlock()
	f(u)
}

// syncRounds counts the sync rounds p logged, ended well or not.
func syncRounds(p *proxyProcess) int {
	return strings.Count(p.logged(), `msg="sync round`)
}

// awaitRound waits for a round to end after the n-th one and returns its
// log line.
func awaitRound(t *testing.T, p *proxyProcess, n int, within time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(within)
	for syncRounds(p) <= n {
		if time.Now().After(deadline) {
			t.Fatalf("no sync round within %v after the %d-th", within, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	lines := strings.Split(p.logged(), "\n")
	seen := 0
	for _, l := range lines {
		if strings.Contains(l, `msg="sync round`) {
			if seen++; seen == n+1 {
				return l
			}
		}
	}
	return ""
}

// awaitRoundWith waits for a sync round, of those to come, whose line
// holds want, and returns how long that took.
func awaitRoundWith(t *testing.T, p *proxyProcess, want string, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for n := syncRounds(p); ; n++ {
		left := within - time.Since(start)
		if left <= 0 {
			t.Fatalf("no sync round within %v logged %s", within, want)
		}
		if strings.Contains(awaitRound(t, p, n, left), want) {
			return time.Since(start)
		}
	}
}

// TestSyncKeepsChosenImagesCached is the targets against a real
// registry, over a relay that counts the bytes leaving it: a rule with a
// 5 s interval and tags ^v[0-9]+$ on a repository holding v1 and dev.
// v1 is cached within two intervals without a client asking, dev never;
// a round in which nothing moved is a tag list and a HEAD (under 100 KB);
// a v2 pushed later, and a v1 moved, are cached within two intervals; a
// 429 is waited out as its Retry-After says, and a nearly spent Docker Hub
// window holds fetches back; tag lists come in pages; and with the
// upstream then unreachable, containerd pulls the synced images through
// pullproxy.
func TestSyncKeepsChosenImagesCached(t *testing.T) {
	ok, why := containerdtest.Available()
	requireTool(t, ok, why)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	up := &syncedUpstream{tagPage: 2}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	relay, err := carrier.Start(carrier.Config{Target: reg.Host()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { relay.Close() })
	push := func(tag string, seed uint64) registrytest.Pushed {
		t.Helper()
		img, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: tag, Seed: seed, LayerSizes: []int64{3 << 20, 200 << 10}})
		if err != nil {
			t.Fatal(err)
		}
		return img
	}
	push("v1", 1)
	dev := push("dev", 2)
	push("x-1", 3) // tags the rule does not keep, and pages to follow
	push("x-2", 3)
	up.asked()

	const host = "reg.test"
	config := writeConfig(t, fmt.Sprintf(`
upstreams:
  - name: %s
    endpoints:
      - url: %s
sync:
  - upstream: %s
    repository: team/app
    tags: ["^v[0-9]+$"]
    interval: 5s
`, host, relay.URL(), host))
	data := filepath.Join(t.TempDir(), "data")
	started := time.Now()
	p := startProxy(t, "--config", config, "--data-dir", data)

	// v1 within two intervals, no client asking; dev never.
	awaitRoundWith(t, p, `fetched_tags=[team/app:v1]`, 10*time.Second-time.Since(started))
	t.Logf("v1 cached %v after start", time.Since(started).Round(time.Millisecond))
	asked := up.asked()
	tagLists := 0
	for _, a := range asked {
		if strings.Contains(a, "/dev") || strings.Contains(a, dev.Manifest.Digest.String()) {
			t.Errorf("dev, which the rule does not keep, was asked for: %s", a)
		}
		if strings.HasSuffix(a, "/tags/list") {
			tagLists++
		}
	}
	if tagLists < 2 {
		t.Errorf("the tag list (4 tags, pages of 2) was asked for %d times, want its pages followed", tagLists)
	}

	// A round in which nothing moved.
	n := syncRounds(p)
	awaitRound(t, p, n, 10*time.Second)
	before := relay.Stats()
	line := awaitRound(t, p, n+1, 10*time.Second)
	after := relay.Stats()
	moved := after.BytesDown - before.BytesDown + after.BytesUp - before.BytesUp
	t.Logf("a round with nothing moved: %d bytes through the relay, both ways: %s", moved, line)
	if !strings.Contains(line, "fetched_tags=[]") {
		t.Errorf("a round with nothing moved fetched: %s", line)
	}
	if moved >= 100_000 {
		t.Errorf("a round with nothing moved moved %d bytes, want under 100 KB", moved)
	}

	// v2, pushed later, and v1 moved: each within two intervals.
	push("v2", 4)
	took := awaitRoundWith(t, p, `fetched_tags=[team/app:v2]`, 10*time.Second)
	t.Logf("v2 cached %v after its push", took.Round(time.Millisecond))
	push("v1", 5)
	took = awaitRoundWith(t, p, `fetched_tags=[team/app:v1]`, 10*time.Second)
	t.Logf("v1 moved: cached %v after its push", took.Round(time.Millisecond))

	// A 429: the next round waits as Retry-After says, then goes on.
	up.set(func(u *syncedUpstream) { u.throttle, u.retryWait = 1, 4 })
	awaitRoundWith(t, p, `msg="sync round failed`, 10*time.Second)
	failedAt := time.Now()
	if !strings.Contains(p.logged(), "the upstream is rate limiting") {
		t.Errorf("the failed round does not say the upstream is rate limiting:\n%s", p.logged())
	}
	n = syncRounds(p)
	awaitRound(t, p, n, 15*time.Second)
	if waited := time.Since(failedAt); waited < 3*time.Second {
		t.Errorf("the round after a 429 with Retry-After: 4 came %v after it", waited)
	}

	// Docker Hub's window nearly spent: the new tag waits; refilled, it is fetched.
	up.set(func(u *syncedUpstream) { u.pullsLeft = 3 })
	up.asked()
	v3 := push("v3", 6)
	awaitRoundWith(t, p, "holding off", 15*time.Second)
	for _, a := range up.asked() {
		if strings.Contains(a, v3.Layers[0].Digest.String()) {
			t.Errorf("a layer of v3 was fetched with 3 pulls of 100 left: %s", a)
		}
	}
	up.set(func(u *syncedUpstream) { u.pullsLeft = 90 })
	awaitRoundWith(t, p, "fetched_tags=[team/app:v3]", 15*time.Second)

	out, err := runPullproxy(ctx, t, "status", "--server", p.AdminURL)
	if err != nil || !strings.Contains(out, "reg.test/team/app every 5s: 3 tags cached") {
		t.Errorf("status does not show the rule (%v):\n%s", err, out)
	}

	// The upstream unreachable: containerd pulls what sync cached.
	relay.Close()
	d, err := containerdtest.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	hosts, err := d.WriteHostsDir(host, p.URL)
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"v1", "v2", "v3"} {
		if out, err := d.ContentFetch(ctx, hosts, host+"/team/app:"+tag); err != nil {
			t.Fatalf("pulling team/app:%s with the upstream unreachable: %v\n%s", tag, err, out)
		}
	}
}

// TestSyncReplicasTakeTurns: two replicas sharing a bucket, with the same
// rule, run one round per interval between them, not one each, and fetch
// the images from the upstream once; with one stopped, the other goes on.
func TestSyncReplicasTakeTurns(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	const bucket = "pullproxy"
	srv := miniotest.ForTest(t, bucket)
	up := &syncedUpstream{}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	img, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v1", Seed: 21, LayerSizes: []int64{4 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	up.asked()
	const interval = 2 * time.Second
	config := writeConfig(t, fmt.Sprintf(`
storage:
  type: s3
  bucket: %s
  endpoint: %s
  path_style: true
  prefix: site1
  lease_ttl: 2s
upstreams:
  - name: reg.test
    endpoints:
      - url: %s
sync:
  - upstream: reg.test
    repository: team/app
    interval: %s
`, bucket, srv.Endpoint, reg.URL(), interval))
	a, b := startReplica(t, srv, config), startReplica(t, srv, config)

	// Six intervals: about seven rounds between the two, not twelve.
	time.Sleep(6 * interval)
	asked := up.asked()
	lists, layerGets := 0, 0
	for _, r := range asked {
		switch {
		case strings.HasSuffix(r, "/tags/list"):
			lists++
		case r == "GET /v2/team/app/blobs/"+img.Layers[0].Digest.String():
			layerGets++
		}
	}
	roundsA, roundsB := syncRounds(a), syncRounds(b)
	t.Logf("six intervals: rounds on A %d, on B %d; tag lists upstream %d; GETs of the layer %d", roundsA, roundsB, lists, layerGets)
	// About seven: one a round, and each replica's first, before it has
	// seen a round counted; twelve or more without turns.
	if roundsA+roundsB > 10 || lists > 10 {
		t.Errorf("%d rounds (%d tag lists) in six intervals between two replicas, want about seven: one replica per round",
			roundsA+roundsB, lists)
	}
	if roundsA+roundsB < 4 {
		t.Errorf("%d rounds in six intervals, want about six", roundsA+roundsB)
	}
	if layerGets == 0 {
		t.Fatalf("the layer was never fetched")
	}
	if got := strings.Count(a.logged()+b.logged(), "fetched_tags=[team/app:v1]"); got != 1 {
		t.Errorf("v1 fetched by %d rounds, want 1: the replica after takes the state the turn hands on", got)
	}

	// A stopped: B goes on alone.
	a.stop()
	n := syncRounds(b)
	if _, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v2", Seed: 22, LayerSizes: []int64{1 << 20}}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(4 * interval); !strings.Contains(b.logged(), "fetched_tags=[team/app:v2]"); {
		if time.Now().After(deadline) {
			t.Fatalf("with A stopped, B did not fetch v2 within two intervals and a lease TTL; B's rounds since: %d", syncRounds(b)-n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestSyncedImagesPinned: what a rule keeps is not evicted however much
// else is pulled through a small store; once its tag moves, the image it
// kept before is unpinned, and goes as anything else.
func TestSyncedImagesPinned(t *testing.T) {
	up := &upstreamLog{n: map[string]int{}}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	const layer = 8704 << 10 // 8.5 MiB: an image of two layers is 17 MiB, the store 40
	push := func(repo, tag string, seed uint64) registrytest.Pushed {
		img, err := reg.Push(t.Context(), registrytest.Image{Repo: repo, Tag: tag, LayerSizes: []int64{layer, layer}, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		return img
	}
	old := push("team/app", "v1", 300)
	var others []registrytest.Pushed
	for i := range 4 {
		others = append(others, push("team/other", fmt.Sprintf("o%d", i), uint64(310+i)))
	}
	config := writeConfig(t, fmt.Sprintf(`
max_size: 40MiB
upstreams:
  - name: reg.test
    endpoints:
      - url: %s
sync:
  - upstream: reg.test
    repository: team/app
    tags: [v1]
    interval: 2s
`, reg.URL()))
	p := startProxy(t, "--config", config, "--data-dir", t.TempDir())
	awaitRoundWith(t, p, "fetched_tags=[team/app:v1]", 10*time.Second)
	for i, img := range others {
		pullThrough(t, p.URL, "team/other", img, fmt.Sprintf("o%d", i))
	}
	if n := metric(t, p.URL, "pullproxy_evicted_blobs_total"); n == 0 {
		t.Fatal("nothing was evicted: the store is not small enough for this test")
	}
	up.take()
	pullThrough(t, p.URL, "team/app", old, "v1")
	if got := up.take(); got["GET blobs"] != 0 {
		t.Errorf("v1, kept by the rule, after 68 MiB through a 40 MiB store: %d upstream blob GETs, want 0", got["GET blobs"])
	}

	// v1 moves: the new image is kept, the old one goes.
	moved := push("team/app", "v1", 301)
	awaitRoundWith(t, p, "fetched_tags=[team/app:v1]", 10*time.Second)
	for i, img := range others[:3] {
		pullThrough(t, p.URL, "team/other", img, fmt.Sprintf("o%d", i))
	}
	up.take()
	pullThrough(t, p.URL, "team/app", moved, "v1")
	if got := up.take(); got["GET blobs"] != 0 {
		t.Errorf("v1 moved, kept by the rule: %d upstream blob GETs, want 0", got["GET blobs"])
	}
	getBody(t, p.URL+"/v2/team/app/blobs/"+old.Layers[0].Digest.String()+"?ns=reg.test")
	if got := up.take(); got["GET blobs"] == 0 {
		t.Error("a layer of the image v1 pointed to before it moved is still stored: it was not unpinned")
	}
}

// TestSyncPrefixRule: a rule on team/* with a semver constraint syncs the
// versions within it of every repository the upstream's catalog lists
// under team/, in pages, and asks nothing of the other repositories, nor
// of the other tags' manifests.
func TestSyncPrefixRule(t *testing.T) {
	up := &syncedUpstream{tagPage: 2}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	for i, ref := range []string{"team/a:1.1.0", "team/a:1.2.0", "team/a:latest", "team/b/c:v2.0.1", "teams/x:1.2.0", "other/y:1.2.0"} {
		repo, tag, _ := strings.Cut(ref, ":")
		if _, err := reg.Push(t.Context(), registrytest.Image{Repo: repo, Tag: tag, Seed: uint64(40 + i), LayerSizes: []int64{100 << 10}}); err != nil {
			t.Fatal(err)
		}
	}
	up.asked()
	config := writeConfig(t, fmt.Sprintf(`
upstreams:
  - name: reg.test
    endpoints:
      - url: %s
sync:
  - upstream: reg.test
    repository: team/*
    semver: ">=1.2"
    interval: 2s
`, reg.URL()))
	p := startProxy(t, "--config", config, "--data-dir", t.TempDir())
	awaitRoundWith(t, p, "repositories=2 tags_cached=2", 10*time.Second)
	for _, want := range []string{"team/a:1.2.0", "team/b/c:v2.0.1"} {
		if !strings.Contains(p.logged(), want) {
			t.Errorf("%s was not fetched", want)
		}
	}
	catalog := 0
	for _, a := range up.asked() {
		if a == "GET /v2/_catalog" {
			catalog++
		}
		if strings.Contains(a, "/teams/") || strings.Contains(a, "/other/") {
			t.Errorf("a repository outside team/ was asked for: %s", a)
		}
		if strings.HasSuffix(a, "/manifests/1.1.0") || strings.HasSuffix(a, "/manifests/latest") {
			t.Errorf("a tag outside the constraint was asked for: %s", a)
		}
	}
	if catalog < 2 {
		t.Errorf("the catalog (4 repositories, pages of 2) was asked for %d times, want its pages followed", catalog)
	}
}

// TestSyncFailingHoldsNothingBack: with the upstream unreachable from the
// start, rounds fail with the cause and the fix, are tried again sooner
// than the interval, and /readyz answers 200 meanwhile.
func TestSyncFailingHoldsNothingBack(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close() // nothing listens there now: connections are refused
	config := writeConfig(t, fmt.Sprintf(`
upstreams:
  - name: reg.test
    endpoints:
      - url: http://%s
sync:
  - upstream: reg.test
    repository: team/app
    interval: 1m
`, dead))
	p := startProxy(t, "--config", config, "--data-dir", t.TempDir())
	awaitRoundWith(t, p, `msg="sync round failed`, 10*time.Second)
	// Backing off from an eighth of the minute: the second attempt
	// within 10 s, not at the interval.
	awaitRoundWith(t, p, "failures_in_a_row=2", 15*time.Second)
	if !strings.Contains(p.logged(), "connection refused") || !strings.Contains(p.logged(), `fix="the upstream did not answer`) {
		t.Errorf("the failed rounds do not say why and what to do:\n%s", p.logged())
	}
	resp, err := http.Get(p.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz while sync rounds fail: %s, want 200", resp.Status)
	}
}
