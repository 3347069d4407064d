package flags

import (
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

// TestVars: every machine flag has a variable, named in its usage and
// listed by Vars with the flag's default, whatever the environment says.
func TestVars(t *testing.T) {
	t.Setenv(config.Prefix+"NODES", "7")
	t.Setenv(config.Prefix+"DATA_DIR", "/elsewhere")
	vars := Vars()
	byName := map[string]Var{}
	for _, v := range vars {
		require.True(t, strings.HasPrefix(v.Name, config.Prefix), v.Name)
		require.NotContains(t, byName, v.Name, "one variable per flag")
		require.NotContains(t, v.Usage, "(env ", v.Name)
		require.NotContains(t, v.Usage, "`", v.Name)
		byName[v.Name] = v
	}
	require.Equal(t, Var{Name: config.Prefix + "NODES", Flag: "nodes", Type: "int", Default: "1",
		Usage: "machines to run in this process, 1 to 20000"}, byName[config.Prefix+"NODES"])
	require.Equal(t, Var{Name: config.Prefix + "DATA_DIR", Flag: "data-dir", Placeholder: "PATH", Type: "string",
		Default: "/var/lib/fakedaemon", Usage: "the machines' directories: PATH/<index> holds machine index's identity and journal"},
		byName[config.Prefix+"DATA_DIR"])
	require.Equal(t, "2m0s", byName[config.Prefix+"JOIN_TOKEN_WAIT"].Default)
	require.Equal(t, "bool", byName[config.Prefix+"INSECURE_TRUST_SERVER_PINS"].Type)
	require.Equal(t, Var{Name: JoinTokenVar, Type: "string", Usage: joinTokenUsage}, vars[len(vars)-1])

	fs := pflag.NewFlagSet("fakedaemon", pflag.ContinueOnError)
	Add(fs, func(string) string { return "" })
	n := 0
	fs.VisitAll(func(fl *pflag.Flag) {
		n++
		env := fl.Annotations[EnvAnnotation]
		require.Len(t, env, 1, fl.Name)
		require.True(t, strings.HasSuffix(fl.Usage, " (env "+env[0]+")"), fl.Usage)
		require.Equal(t, fl.Name, byName[env[0]].Flag)
	})
	require.Len(t, vars, n+1, "every flag, and the token")
}

// TestAddReadsEnv: a variable sets its flag's default; a malformed one
// fails Config, naming it.
func TestAddReadsEnv(t *testing.T) {
	env := map[string]string{config.Prefix + "NODES": "3", config.Prefix + "JOIN_TOKEN_WAIT": "5s",
		config.Prefix + "INSECURE_TRUST_SERVER_PINS": "true", config.Prefix + "SERVER": "http://api:8080",
		config.Prefix + "PPROF_LISTEN": "127.0.0.1:6061", JoinTokenVar: "bcjt_x"}
	getenv := func(k string) string { return env[k] }
	f := Add(pflag.NewFlagSet("fakedaemon", pflag.ContinueOnError), getenv)
	cfg, err := f.Config(false)
	require.NoError(t, err)
	require.Equal(t, 3, cfg.Nodes)
	require.Equal(t, 5*time.Second, cfg.TokenWait)
	require.True(t, cfg.InsecureTrustServerPins)
	require.Equal(t, "bcjt_x", cfg.Token)
	require.Equal(t, "127.0.0.1:6061", cfg.PprofListen, "the services' variable profiles the machines' process too")

	for _, tc := range []struct{ name, value string }{
		{name: config.Prefix + "NODES", value: "many"},
		{name: config.Prefix + "JOIN_TOKEN_WAIT", value: "soon"},
		{name: config.Prefix + "INSECURE_TRUST_SERVER_PINS", value: "yes please"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bad := maps.Clone(env)
			bad[tc.name] = tc.value
			f := Add(pflag.NewFlagSet("fakedaemon", pflag.ContinueOnError), func(k string) string { return bad[k] })
			_, err := f.Config(false)
			require.ErrorContains(t, err, tc.name+": ")
		})
	}
}

func TestParseCommandDurations(t *testing.T) {
	def := fakehw.DefaultDurations()
	with := func(kv map[string]time.Duration) fakehw.Durations {
		d := fakehw.DefaultDurations()
		maps.Copy(d.ByKind, kv)
		return d
	}
	for _, tc := range []struct {
		name, list string
		want       fakehw.Durations
		wantErr    string
	}{
		{name: "one kind", list: "diag.nvml=0", want: with(map[string]time.Duration{"diag.nvml": 0})},
		{name: "kinds", list: "diag.nvml=0, logs.collect = 2s,node.reboot=1m30s",
			want: with(map[string]time.Duration{"diag.nvml": 0, "logs.collect": 2 * time.Second, "node.reboot": 90 * time.Second})},
		{name: "every kind", list: "diag.nvml=1ms,inventory.refresh=2ms,logs.collect=3ms,node.reboot=4ms",
			want: fakehw.Durations{ByKind: map[string]time.Duration{"diag.nvml": time.Millisecond,
				"inventory.refresh": 2 * time.Millisecond, "logs.collect": 3 * time.Millisecond,
				"node.reboot": 4 * time.Millisecond}, Default: def.Default}},
		{name: "default replaces the unlisted kinds", list: "diag.nvml=0,logs.collect=2s,default=1s",
			want: fakehw.Durations{ByKind: map[string]time.Duration{"diag.nvml": 0, "logs.collect": 2 * time.Second},
				Default: time.Second}},
		{name: "default alone", list: "default=0s", want: fakehw.Durations{ByKind: map[string]time.Duration{}}},
		{name: "unknown kind", list: "diag.nvml=0,gpu.reset=1s",
			wantErr: `item "gpu.reset=1s": unknown command kind "gpu.reset" (valid: diag.nvml, inventory.refresh, logs.collect, node.reboot, default)`},
		{name: "bad duration", list: "logs.collect=2", wantErr: `item "logs.collect=2": time: missing unit in duration "2"`},
		{name: "not a duration", list: "logs.collect=soon", wantErr: `item "logs.collect=soon": time: invalid duration "soon"`},
		{name: "negative", list: "node.reboot=-1s", wantErr: `item "node.reboot=-1s": duration must not be negative`},
		{name: "no equals", list: "diag.nvml", wantErr: `item "diag.nvml": want KIND=DURATION`},
		{name: "no value", list: "diag.nvml=", wantErr: `item "diag.nvml=": want KIND=DURATION`},
		{name: "no kind", list: "=1s", wantErr: `item "=1s": want KIND=DURATION`},
		{name: "empty item", list: "diag.nvml=0,,logs.collect=1s", wantErr: `empty item in "diag.nvml=0,,logs.collect=1s"`},
		{name: "trailing comma", list: "diag.nvml=0,", wantErr: "empty item"},
		{name: "kind twice", list: "diag.nvml=0,diag.nvml=1s", wantErr: `item "diag.nvml=1s": diag.nvml given twice`},
		{name: "default twice", list: "default=0,default=1s", wantErr: `item "default=1s": default given twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseCommandDurations(tc.list)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
	require.Equal(t, 800*time.Millisecond, def.ByKind["diag.nvml"], "parsing leaves the defaults alone")
}
