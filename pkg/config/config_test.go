package config_test

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/config"
)

// shared is a struct several configs embed.
type shared struct {
	// Dir is a directory.
	Dir string `env:"DIR" default:"/var/lib/x"`
	// On switches something on.
	On bool `env:"ON"`
}

// level is a TextUnmarshaler.
type level int

func (l *level) UnmarshalText(b []byte) error {
	switch string(b) {
	case "low":
		*l = 1
	case "high":
		*l = 2
	default:
		return fmt.Errorf("want low or high, got %q", b)
	}
	return nil
}

type inner struct {
	Batch int `env:"BATCH" default:"500"`
	// Size is no variable, but has a default.
	Size int `default:"64"`
}

type cfg struct {
	shared
	Listen   string        `env:"LISTEN" default:":8080"`
	Interval time.Duration `env:"INTERVAL,positive" default:"2s"`
	Idle     time.Duration `env:"IDLE"`
	Level    level         `env:"LEVEL" default:"low"`
	Tuning   inner
	// Programmatic is not a variable.
	Programmatic *strings.Builder
	Other        string
}

type overridden struct {
	shared `default:"DIR="`
	Name   string `env:"NAME"`
}

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// TestLoadDefaults: unset and empty variables take their defaults, or leave
// the field as it is without one.
func TestLoadDefaults(t *testing.T) {
	t.Parallel()
	c := cfg{Other: "kept", Idle: time.Minute}
	require.NoError(t, config.Load(&c, env(map[string]string{"BETTER_COMPUTE_LISTEN": ""})))
	require.Equal(t, cfg{shared: shared{Dir: "/var/lib/x"}, Listen: ":8080", Interval: 2 * time.Second, Idle: time.Minute,
		Level: 1, Tuning: inner{Batch: 500, Size: 64}, Other: "kept"}, c)
}

// TestLoadValues reads every kind of field.
func TestLoadValues(t *testing.T) {
	t.Parallel()
	var c cfg
	require.NoError(t, config.Load(&c, env(map[string]string{
		"BETTER_COMPUTE_DIR": "/pki", "BETTER_COMPUTE_ON": "true", "BETTER_COMPUTE_LISTEN": ":9",
		"BETTER_COMPUTE_INTERVAL": "1m", "BETTER_COMPUTE_IDLE": "-1s", "BETTER_COMPUTE_LEVEL": "high",
		"BETTER_COMPUTE_BATCH": "7",
	})))
	require.Equal(t, cfg{shared: shared{Dir: "/pki", On: true}, Listen: ":9", Interval: time.Minute, Idle: -time.Second,
		Level: 2, Tuning: inner{Batch: 7, Size: 64}}, c)
}

// TestLoadErrors: every refused value is reported, naming its variable.
func TestLoadErrors(t *testing.T) {
	t.Parallel()
	var c cfg
	err := config.Load(&c, env(map[string]string{
		"BETTER_COMPUTE_ON": "yes please", "BETTER_COMPUTE_INTERVAL": "0s", "BETTER_COMPUTE_IDLE": "soon",
		"BETTER_COMPUTE_LEVEL": "mid", "BETTER_COMPUTE_BATCH": "many",
	}))
	require.EqualError(t, err, strings.Join([]string{
		`BETTER_COMPUTE_ON: want true or false, got "yes please"`,
		`BETTER_COMPUTE_INTERVAL: must be positive, got "0s"`,
		`BETTER_COMPUTE_IDLE: want a duration such as 30s or 5m, got "soon"`,
		`BETTER_COMPUTE_LEVEL: want low or high, got "mid"`,
		`BETTER_COMPUTE_BATCH: want a whole number, got "many"`,
	}, "\n"))
	var e *config.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, "BETTER_COMPUTE_ON", e.Name)
	require.EqualError(t, errors.Unwrap(e), `want true or false, got "yes please"`)
}

// TestOverrides: an embedding's default tag replaces the defaults inside.
func TestOverrides(t *testing.T) {
	t.Parallel()
	var o overridden
	require.NoError(t, config.Load(&o, env(nil)))
	require.Empty(t, o.Dir)
	vars := config.Vars(reflect.TypeFor[overridden]())
	require.Equal(t, []string{"BETTER_COMPUTE_DIR", "BETTER_COMPUTE_ON", "BETTER_COMPUTE_NAME"}, names(vars))
	require.Empty(t, vars[0].Default)
	require.Equal(t, "/var/lib/x", config.Vars(reflect.TypeFor[*cfg]())[0].Default)
}

// TestSetDefaults fills zero fields only.
func TestSetDefaults(t *testing.T) {
	t.Parallel()
	c := cfg{Listen: ":1", Tuning: inner{Batch: 3}}
	config.SetDefaults(&c)
	require.Equal(t, cfg{shared: shared{Dir: "/var/lib/x"}, Listen: ":1", Interval: 2 * time.Second, Level: 1,
		Tuning: inner{Batch: 3, Size: 64}}, c)
}

// TestVars lists names, defaults, checks and where each field is declared.
func TestVars(t *testing.T) {
	t.Parallel()
	vars := config.Vars(reflect.TypeFor[cfg]())
	require.Equal(t, []string{"BETTER_COMPUTE_DIR", "BETTER_COMPUTE_ON", "BETTER_COMPUTE_LISTEN", "BETTER_COMPUTE_INTERVAL",
		"BETTER_COMPUTE_IDLE", "BETTER_COMPUTE_LEVEL", "BETTER_COMPUTE_BATCH"}, names(vars))
	require.Equal(t, config.Var{Name: "BETTER_COMPUTE_INTERVAL", Default: "2s", Positive: true,
		Type: reflect.TypeFor[time.Duration](), Owner: reflect.TypeFor[cfg](), Field: "Interval"}, vars[3])
	require.Equal(t, reflect.TypeFor[shared](), vars[0].Owner)
	require.Equal(t, reflect.TypeFor[inner](), vars[6].Owner)
}

// TestMisuse panics on what only a programming error causes.
func TestMisuse(t *testing.T) {
	t.Parallel()
	require.Panics(t, func() { _ = config.Load(cfg{}, env(nil)) })
	require.Panics(t, func() {
		var c struct {
			X float64 `env:"X"`
		}
		_ = config.Load(&c, env(nil))
	})
	require.Panics(t, func() {
		var c struct {
			X string `env:"X,positive"`
		}
		_ = config.Load(&c, env(nil))
	})
	require.Panics(t, func() {
		var c struct {
			X time.Duration `env:"X" default:"often"`
		}
		config.SetDefaults(&c)
	})
}

func names(vars []config.Var) []string {
	out := make([]string, len(vars))
	for i, v := range vars {
		out[i] = v.Name
	}
	return out
}
