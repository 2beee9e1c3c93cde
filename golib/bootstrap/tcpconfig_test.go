package bootstrap

import (
	"strings"
	"testing"
	"time"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

func envOf(kv map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := kv[k]
		return v, ok
	}
}

// torchrunEnv is what torchrun sets for rank 1 of 4.
func torchrunEnv(extra ...string) map[string]string {
	env := map[string]string{
		"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
		"MASTER_ADDR": "node-3", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job-a",
	}
	for i := 0; i+1 < len(extra); i += 2 {
		if extra[i+1] == "<unset>" {
			delete(env, extra[i])
		} else {
			env[extra[i]] = extra[i+1]
		}
	}
	return env
}

func TestTCPConfigFromEnv(t *testing.T) {
	base := TCPConfig{Rank: 1, Size: 4, Addr: "node-3", Port: 29501, Timeout: DefaultTimeout,
		Token: hashToken("job-a\x00node-3\x0029501\x004")}
	tests := []struct {
		name string
		env  map[string]string
		want TCPConfig
	}{
		{"torchrun", torchrunEnv(), base},
		{"overrides", torchrunEnv("P2PCOMM_RANK", "3", "P2PCOMM_WORLD_SIZE", "8", "P2PCOMM_MASTER_ADDR", "10.0.0.1",
			"P2PCOMM_MASTER_PORT", "4000", "P2PCOMM_TIMEOUT_MS", "1500", "P2PCOMM_JOB_TOKEN", "0x2a"),
			TCPConfig{Rank: 3, Size: 8, Addr: "10.0.0.1", Port: 4000, Timeout: 1500 * time.Millisecond, Token: 42}},
		{"text token", torchrunEnv("P2PCOMM_JOB_TOKEN", "my-job"), func() TCPConfig { c := base; c.Token = hashToken("my-job"); return c }()},
		{"default address", torchrunEnv("MASTER_ADDR", "<unset>"), func() TCPConfig {
			c := base
			c.Addr, c.Token = "127.0.0.1", hashToken("job-a\x00127.0.0.1\x0029501\x004")
			return c
		}()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := TCPConfigFromEnv(envOf(tt.env))
			if err != nil || got != tt.want {
				t.Errorf("TCPConfigFromEnv = %+v, %v; want %+v, nil", got, err, tt.want)
			}
		})
	}
}

func TestTCPConfigFromEnvTokenDependsOnJob(t *testing.T) {
	a, _ := TCPConfigFromEnv(envOf(torchrunEnv()))
	for _, change := range [][]string{
		{"TORCHELASTIC_RUN_ID", "job-b"}, {"MASTER_PORT", "29600"}, {"MASTER_ADDR", "node-4"}, {"WORLD_SIZE", "5"},
	} {
		b, err := TCPConfigFromEnv(envOf(torchrunEnv(change...)))
		if err != nil || b.Token == a.Token {
			t.Errorf("with %s=%s: token %#x, %v; want a token other than %#x", change[0], change[1], b.Token, err, a.Token)
		}
	}
}

func TestTCPConfigFromEnvRejects(t *testing.T) {
	tests := []struct {
		name string
		env  map[string]string
		code status.Code
		want string
	}{
		{"no rank", torchrunEnv("RANK", "<unset>"), status.Bootstrap, "neither P2PCOMM_RANK nor RANK is set"},
		{"no size", torchrunEnv("WORLD_SIZE", "<unset>"), status.Bootstrap, "neither P2PCOMM_WORLD_SIZE nor WORLD_SIZE"},
		{"no port", torchrunEnv("MASTER_PORT", "<unset>"), status.Bootstrap, "neither P2PCOMM_MASTER_PORT nor MASTER_PORT"},
		{"rank text", torchrunEnv("RANK", "one"), status.InvalidArgument, `RANK="one" is not an integer`},
		{"override rank text", torchrunEnv("P2PCOMM_RANK", "x"), status.InvalidArgument, `P2PCOMM_RANK="x"`},
		{"rank too big", torchrunEnv("RANK", "4"), status.InvalidArgument, "RANK=4 out of range [0, 4)"},
		{"rank negative", torchrunEnv("P2PCOMM_RANK", "-1"), status.InvalidArgument, "P2PCOMM_RANK=-1 out of range"},
		{"size zero", torchrunEnv("WORLD_SIZE", "0"), status.InvalidArgument, "WORLD_SIZE=0, want >= 1"},
		{"port text", torchrunEnv("MASTER_PORT", "http"), status.InvalidArgument, `MASTER_PORT="http"`},
		{"port last", torchrunEnv("MASTER_PORT", "65535"), status.InvalidArgument, "MASTER_PORT+1"},
		{"override port", torchrunEnv("P2PCOMM_MASTER_PORT", "70000"), status.InvalidArgument, `P2PCOMM_MASTER_PORT="70000"`},
		{"timeout text", torchrunEnv("P2PCOMM_TIMEOUT_MS", "2s"), status.InvalidArgument, `P2PCOMM_TIMEOUT_MS="2s"`},
		{"timeout zero", torchrunEnv("P2PCOMM_TIMEOUT_MS", "0"), status.InvalidArgument, `P2PCOMM_TIMEOUT_MS="0"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := TCPConfigFromEnv(envOf(tt.env))
			if status.CodeOf(err) != tt.code || !strings.Contains(errString(err), tt.want) {
				t.Errorf("TCPConfigFromEnv = %v (code %v), want a %v error containing %q", err, status.CodeOf(err), tt.code, tt.want)
			}
		})
	}
}

func TestLaunchedByMPI(t *testing.T) {
	tests := []struct {
		env  map[string]string
		want bool
	}{
		{torchrunEnv(), false},
		{map[string]string{"OMPI_COMM_WORLD_SIZE": "2"}, true},
		{map[string]string{"PMI_SIZE": "2"}, true},
		{map[string]string{"PMIX_RANK": "0"}, true},
	}
	for _, tt := range tests {
		if got := LaunchedByMPI(envOf(tt.env)); got != tt.want {
			t.Errorf("LaunchedByMPI(%v) = %v, want %v", tt.env, got, tt.want)
		}
	}
}
