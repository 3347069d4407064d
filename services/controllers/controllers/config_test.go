package controllers_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// TestReconcilerLeases: each reconciler of the list runs behind its own
// lease, named as the package documents.
func TestReconcilerLeases(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	_, nc := startNATS(t)
	srv, err := controllers.New(controllers.Config{Probes: service.Probes{NoHealthServer: true}}, controllers.Deps{DB: db, NC: nc})
	require.NoError(t, err)
	require.Equal(t, []string{controllers.LeaseAcceptance, controllers.LeaseExpiry, controllers.LeaseUsage,
		controllers.LeaseLiveness, controllers.LeaseCommandExpiry, controllers.LeaseSSHCAs,
		controllers.LeaseJoining, controllers.LeaseRetention}, srv.LeaseNames())
}

// TestConfigDefaults: the variables' defaults are the reconcilers' own, so
// that a reconciler built without Config behaves as the service does.
func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	var cfg controllers.Config
	config.SetDefaults(&cfg)
	require.Equal(t, controllers.DefaultAcceptanceTimeout, cfg.AcceptanceTimeout)
	require.Equal(t, controllers.DefaultAcceptanceAttempts, cfg.AcceptanceAttempts)
	require.Equal(t, controllers.DefaultReconcileInterval, cfg.ReconcileInterval)
	require.Equal(t, controllers.DefaultBatchSize, cfg.BatchSize)
	require.Equal(t, controllers.DefaultExpiryInterval, cfg.ExpiryInterval)
	require.Equal(t, controllers.DefaultCommandExpiryInterval, cfg.ExpiryInterval)
	require.Equal(t, controllers.DefaultUsageInterval, cfg.UsageInterval)
	require.Equal(t, controllers.DefaultLivenessTimeout, cfg.LivenessTimeout)
	require.Equal(t, controllers.DefaultLivenessInterval, cfg.LivenessInterval)
	require.Equal(t, lease.DefaultTTL, cfg.LeaseTTL)
}
