package cli

import (
	"reflect"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/config"
)

// TestDevConfigKeys: a dev configuration file holds exactly the variables
// of DevSettings, each explained.
func TestDevConfigKeys(t *testing.T) {
	t.Parallel()
	var names []string
	for _, v := range config.Vars(reflect.TypeFor[DevSettings]()) {
		names = append(names, v.Name)
	}
	slices.Sort(names)
	require.Equal(t, names, devConfigNames())
}
