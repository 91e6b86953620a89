package main

import "testing"

func TestParseWrk(t *testing.T) {
	const ok = `Running 5s test @ http://127.0.0.1:5055/v2/node/app/blobs/sha256:ab
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.21ms    1.10ms  20.01ms   80.00%
    Req/Sec    14.86k     1.01k   16.90k    70.00%
  148623 requests in 5.01s, 14.77GB read
  Socket errors: connect 0, read 2, write 1, timeout 0
Requests/sec:  29696.35
Transfer/sec:      2.96GB
`
	tests := []struct {
		name    string
		out     string
		want    wrkRun
		wantErr bool
	}{
		{"a run", ok, wrkRun{RequestsPerSec: 29696.35, BytesPerSec: 2.96 * (1 << 30), Requests: 148623, SocketErrors: 3}, false},
		{"non-2xx answers", ok + "  Non-2xx or 3xx responses: 12\n", wrkRun{}, true},
		{"no figures", "unable to connect to 127.0.0.1:1 Connection refused\n", wrkRun{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseWrk(tt.out)
			if (err != nil) != tt.wantErr {
				t.Fatalf("error: got %v, want error %v", err, tt.wantErr)
			}
			if !tt.wantErr && got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}
