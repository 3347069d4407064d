// Command bc-healthcheck GETs a URL and exits 0 when it answers 200 OK. It is
// the compose health check of images that have no shell (NATS on scratch).
// It imports nothing of the project, so the NATS image it goes into is
// rebuilt only when this file changes.
//
// Usage: bc-healthcheck URL
package main

import (
	"fmt"
	"net/http"
	"os"
	"time"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: bc-healthcheck URL")
		os.Exit(2)
	}
	c := &http.Client{Timeout: 3 * time.Second}
	resp, err := c.Get(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "healthcheck:", err)
		os.Exit(1)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintln(os.Stderr, "healthcheck:", resp.Status)
		os.Exit(1)
	}
}
