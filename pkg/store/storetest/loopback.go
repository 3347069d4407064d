package storetest

import (
	"net/netip"
	"os"

	"github.com/moby/moby/api/types/container"
	"github.com/moby/moby/api/types/network"
	"github.com/testcontainers/testcontainers-go"
)

// UseLocalDocker sets what testcontainers needs on these machines, unless
// already set: Ryuk off (its image cannot be pulled; tests terminate their
// own containers) and mapped ports reached on localhost (testcontainers would
// otherwise take the default gateway for the Docker host when it finds
// /.dockerenv).
func UseLocalDocker() {
	if os.Getenv("TESTCONTAINERS_RYUK_DISABLED") == "" {
		os.Setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
	}
	if os.Getenv("TESTCONTAINERS_HOST_OVERRIDE") == "" {
		os.Setenv("TESTCONTAINERS_HOST_OVERRIDE", "localhost")
	}
}

// LoopbackPorts publishes the given container ports ("5432/tcp") on
// 127.0.0.1 only, on free host ports, so that nothing listens beyond the
// machine's loopback.
func LoopbackPorts(ports ...string) testcontainers.CustomizeRequestOption {
	return testcontainers.WithHostConfigModifier(func(hc *container.HostConfig) {
		if hc.PortBindings == nil {
			hc.PortBindings = network.PortMap{}
		}
		for _, p := range ports {
			hc.PortBindings[network.MustParsePort(p)] = []network.PortBinding{{HostIP: netip.MustParseAddr("127.0.0.1")}}
		}
	})
}
