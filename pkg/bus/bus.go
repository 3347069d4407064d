// Package bus connects to NATS, which carries better-compute's hints (pokes)
// and events. Postgres stays the source of truth: losing a message here only
// delays work. Tests run an in-process server with package bustest.
package bus

import (
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
)

// Connect dials the NATS server at url as name and keeps reconnecting forever.
func Connect(url, name string, logger *slog.Logger) (*nats.Conn, error) {
	nc, err := nats.Connect(url,
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond),
		nats.RetryOnFailedConnect(true),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				logger.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { logger.Info("nats reconnected", "url", c.ConnectedUrl()) }),
	)
	if err != nil {
		return nil, fmt.Errorf("connect nats %s: %w", url, err)
	}
	return nc, nil
}

// PublishWithID returns a function that publishes payload on subject
// through nc, with the header named header set to id in decimal when id is
// not 0: store.DB.PokeVia's publish, with store.OutboxIDHeader, so that a
// message a writer publishes itself names the outbox row it is a copy of,
// as the relay's copy does.
func PublishWithID(nc *nats.Conn, header string) func(subject string, payload []byte, id int64) error {
	return func(subject string, payload []byte, id int64) error {
		if id == 0 {
			return nc.Publish(subject, payload)
		}
		m := &nats.Msg{Subject: subject, Data: payload, Header: nats.Header{}}
		m.Header.Set(header, strconv.FormatInt(id, 10))
		return nc.PublishMsg(m)
	}
}
