package joinservice

import (
	"context"
	"crypto/x509"
	"slices"
	"sync"
	"time"

	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
)

// maxBatch caps how many joins one statement records.
const maxBatch = 256

// batchTimeout bounds one batch's statement; it runs detached from any one
// caller's context, since it carries other callers' joins too.
const batchTimeout = 30 * time.Second

// joinReq is one join waiting to be recorded: its node and certificate are
// made before the token is counted (signing needs no lock); they are
// dropped, never sent, when the token is refused.
type joinReq struct {
	hash []byte
	node store.NewNode
	cert *x509.Certificate
	// done receives the outcome; lead tells a waiting request that it is
	// the next leader and must record the queue.
	done chan joinResult
	lead chan struct{}
}

type joinResult struct {
	token store.JoinToken
	err   error
	// rejoin, when set, is the node the request's key joined as already:
	// the request is a retry, answered with that node (Server.rejoin); no
	// node was made and no use counted for it.
	rejoin *store.JoinedKey
}

// batcher records concurrent joins in shared statements (group commit).
// Every join of a token locks that token's row until commit, so joins one
// statement each would queue behind each other's commits; a batch takes the
// lock once for all its joins. There is no background goroutine: the
// first caller to find no batch running records the queue (leader), and hands
// the lead to the first caller still queued when it is done.
type batcher struct {
	db *store.DB

	mu      sync.Mutex
	queue   []*joinReq
	leading bool
}

// do records r (alone or with others) and returns its outcome.
func (b *batcher) do(ctx context.Context, r *joinReq) joinResult {
	r.done = make(chan joinResult, 1)
	r.lead = make(chan struct{}, 1)
	b.mu.Lock()
	b.queue = append(b.queue, r)
	if !b.leading {
		b.leading = true
		b.mu.Unlock()
		b.lead()
	} else {
		b.mu.Unlock()
	}
	for {
		select {
		case res := <-r.done:
			return res
		case <-r.lead:
			b.lead()
		case <-ctx.Done():
			// The join may still be recorded by the batch it is in; the
			// machine, having given up, joins again with a new key.
			// Leadership is not lost: whoever hands it over skips callers
			// that are gone only by the batch finishing for them.
			go func() {
				for {
					select {
					case <-r.done:
						return
					case <-r.lead:
						b.lead()
					}
				}
			}()
			return joinResult{err: ctx.Err()}
		}
	}
}

// lead records one batch from the queue, then hands the lead to the next
// queued request, or gives it up when the queue is empty.
func (b *batcher) lead() {
	b.mu.Lock()
	n := min(len(b.queue), maxBatch)
	batch := slices.Clone(b.queue[:n])
	b.queue = slices.Delete(b.queue, 0, n)
	b.mu.Unlock()

	results := b.record(batch)
	for i, r := range batch {
		r.done <- results[i]
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.queue) == 0 {
		b.leading = false
		return
	}
	b.queue[0].lead <- struct{}{}
}

// record records the batch in one statement with no transaction around it
// (store.RecordJoins on AutoCommit: the tokens' locks, the keys that joined
// before, the uses, nodes, certificates, node.joined events and the
// controllers' poke), and returns each join's outcome. A statement that
// fails on a serialization failure or a deadlock is run again, as InTx
// would run its transaction again.
func (b *batcher) record(batch []*joinReq) []joinResult {
	ctx, cancel := context.WithTimeout(context.Background(), batchTimeout)
	defer cancel()
	joins := make([]store.Join, len(batch))
	now := b.db.Now()
	for i, r := range batch {
		n := r.node
		joins[i] = store.Join{TokenHash: r.hash, Node: n, Cert: store.NewNodeCert{
			Serial: pki.SerialHex(r.cert), NodeID: n.ID, PublicKeySHA256: pki.PublicKeySHA256(r.cert),
			NotBefore: r.cert.NotBefore, NotAfter: r.cert.NotAfter, CreatedAt: now,
		}}
	}
	var (
		out []store.JoinOutcome
		err error
	)
	for range maxStatementAttempts {
		if out, err = store.RecordJoins(ctx, b.db.AutoCommit(), now, joins); !store.IsRetryable(err) {
			break
		}
	}
	results := make([]joinResult, len(batch))
	for i := range results {
		if err != nil {
			results[i] = joinResult{err: err}
			continue
		}
		results[i] = joinResult{token: out[i].Token, err: out[i].Err, rejoin: out[i].Rejoin}
	}
	return results
}

// maxStatementAttempts is how many times record runs its statement when it
// fails on a serialization failure or a deadlock (InTx's count).
const maxStatementAttempts = 10
