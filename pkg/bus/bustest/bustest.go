// Package bustest runs an in-process NATS server for tests. It lives apart
// from package bus so that the service binaries do not link the NATS
// server: its process-statistics package samples /proc/self/stat every
// second from init in any binary that imports it.
package bustest

import (
	"fmt"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// StartEmbedded runs a NATS server with JetStream on a free loopback port,
// storing streams under storeDir. Call Shutdown on the result when done.
func StartEmbedded(storeDir string) (*server.Server, error) {
	s, err := server.NewServer(&server.Options{
		Host:      "127.0.0.1",
		Port:      -1,
		JetStream: true,
		StoreDir:  storeDir,
		NoSigs:    true,
		NoLog:     true,
	})
	if err != nil {
		return nil, err
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("embedded nats not ready")
	}
	return s, nil
}
