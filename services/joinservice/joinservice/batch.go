package joinservice

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
)

// maxBatch caps how many joins one transaction records.
const maxBatch = 256

// batchTimeout bounds one batch's transaction; it runs detached from any one
// caller's context, since it carries other callers' joins too.
const batchTimeout = 30 * time.Second

// joinReq is one join waiting to be recorded: its node and certificate are
// made before the token is checked (signing needs no lock); they are dropped,
// never sent, when the token is refused.
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

// errSameKeyInBatch refuses a join whose key another join of its batch
// joins with: once that one is recorded, the caller joins again and finds
// it (a retry sent before the first attempt's answer).
var errSameKeyInBatch = errors.New("the same key joins in this batch")

// batcher records concurrent joins in shared transactions (group commit).
// Every join of a token locks that token's row until commit, so joins one
// transaction each would queue behind each other's commits; a batch takes
// the lock once for all its joins. There is no background goroutine: the
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

// record counts the batch's token uses and creates its nodes, certificates,
// node.joined events and controllers poke in one transaction (per token a
// lock and a read of the keys that joined, then one statement for all,
// store.RecordJoins), and returns each join's outcome.
func (b *batcher) record(batch []*joinReq) []joinResult {
	ctx, cancel := context.WithTimeout(context.Background(), batchTimeout)
	defer cancel()
	results := make([]joinResult, len(batch))
	err := b.db.InTx(ctx, func(tx pgx.Tx) error {
		clear(results)
		now := b.db.Now()
		// Lock tokens in one order, so batches of two replicas never
		// deadlock.
		order := make([]int, len(batch))
		for i := range order {
			order[i] = i
		}
		slices.SortStableFunc(order, func(x, y int) int { return bytes.Compare(batch[x].hash, batch[y].hash) })
		var (
			uses  []store.JoinTokenUses
			nodes []store.NewNode
			certs []store.NewNodeCert
		)
		for start := 0; start < len(order); {
			end := start
			for end < len(order) && bytes.Equal(batch[order[end]].hash, batch[order[start]].hash) {
				end++
			}
			group := order[start:end]
			start = end
			token, err := store.LockJoinToken(ctx, tx, batch[group[0]].hash, now)
			var refusal *store.JoinTokenRefusal
			switch {
			case err != nil && !errors.As(err, &refusal):
				return err
			case err != nil:
				for _, i := range group {
					results[i].err = err
				}
				continue
			}
			// Keys that joined before are retries: answered with their node,
			// counting no use (a lost answer, a machine restarted mid-join).
			keys := make([][]byte, len(group))
			for k, i := range group {
				keys[k] = pki.PublicKeySHA256(batch[i].cert)
			}
			joined, err := store.JoinedKeys(ctx, tx, keys)
			if err != nil {
				return err
			}
			fresh := group[:0:0]
			seen := map[string]bool{}
			for k, i := range group {
				key := hex.EncodeToString(keys[k])
				if j, ok := joined[key]; ok {
					results[i].token, results[i].rejoin = token, &j
					continue
				}
				if seen[key] {
					results[i].err = errSameKeyInBatch
					continue
				}
				seen[key] = true
				fresh = append(fresh, i)
			}
			if len(fresh) == 0 {
				continue
			}
			granted, err := store.GrantJoinTokenUses(token, len(fresh))
			switch {
			case err != nil && !errors.As(err, &refusal):
				return err
			case err != nil:
				for _, i := range fresh {
					results[i].err = err
				}
				continue
			}
			uses = append(uses, store.JoinTokenUses{TokenID: token.ID, Uses: granted})
			for k, i := range fresh {
				if k >= granted {
					used := token
					used.Uses = token.MaxUses
					results[i].err = &store.JoinTokenRefusal{Reason: store.ErrJoinTokenUsedUp, Token: used}
					continue
				}
				r := batch[i]
				t := token
				t.Uses = token.Uses + int32(k) + 1
				results[i].token = t
				n := r.node
				n.PoolID, n.JoinTokenID, n.CreatedAt = token.PoolID, token.ID, now
				nodes = append(nodes, n)
				certs = append(certs, store.NewNodeCert{
					Serial: pki.SerialHex(r.cert), NodeID: n.ID, PublicKeySHA256: pki.PublicKeySHA256(r.cert),
					NotBefore: r.cert.NotBefore, NotAfter: r.cert.NotAfter, CreatedAt: now,
				})
			}
		}
		if len(nodes) == 0 {
			return nil
		}
		// The uses, nodes, certificates, node.joined events and the
		// controllers' poke: one statement.
		return store.RecordJoins(ctx, tx, now, uses, nodes, certs)
	})
	if err != nil {
		for i := range results {
			results[i] = joinResult{err: err}
		}
	}
	return results
}
