// Package containers starts the Postgres and NATS containers of the
// integration suites from the locally built images (`make images`): no image
// is ever pulled. Ryuk is disabled (its image cannot be pulled here), so every
// container is terminated by the test's cleanup.
package containers

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"

	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func init() {
	if os.Getenv("TESTCONTAINERS_RYUK_DISABLED") == "" {
		os.Setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
	}
}

// NATSImage is the NATS image: BETTER_COMPUTE_NATS_IMAGE or better-compute/nats:2.15.2.
func NATSImage() string {
	if v := os.Getenv("BETTER_COMPUTE_NATS_IMAGE"); v != "" {
		return v
	}
	return "better-compute/nats:2.15.2"
}

// NATS starts a NATS server with JetStream and returns its nats:// URL on a
// loopback port. The container is terminated when the test ends.
func NATS(t testing.TB) string {
	t.Helper()
	ctx := context.Background()
	storetest.UseLocalDocker()
	c, err := testcontainers.Run(ctx, NATSImage(),
		testcontainers.WithCmd("-js", "-m", "8222"),
		testcontainers.WithExposedPorts("4222/tcp", "8222/tcp"),
		storetest.LoopbackPorts("4222/tcp", "8222/tcp"),
		testcontainers.WithWaitStrategy(wait.ForHTTP("/healthz").WithPort("8222/tcp")),
	)
	if c != nil {
		t.Cleanup(func() { _ = c.Terminate(context.Background()) })
	}
	if err != nil {
		t.Fatalf("start NATS from %s (run make images): %v", NATSImage(), err)
	}
	host, err := c.Host(ctx)
	if err != nil {
		t.Fatal(err)
	}
	port, err := c.MappedPort(ctx, "4222/tcp")
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("nats://%s:%s", host, port.Port())
}

// Postgres returns the URL of a fresh, migrated database on a Postgres
// container started from the local image (one container per test process, see
// storetest; BETTER_COMPUTE_TEST_DATABASE_URL points elsewhere instead).
func Postgres(t testing.TB) string {
	t.Helper()
	return storetest.NewURL(t)
}

// Stop terminates the process's Postgres container; call it from TestMain.
func Stop() { storetest.Stop() }
