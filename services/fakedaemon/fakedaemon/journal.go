package fakedaemon

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
)

// Journal file names inside a machine's directory.
const (
	// JournalFile holds the journal: a header line, then one JSON record
	// per Put or Delete, appended and fsynced.
	JournalFile = "journal.jsonl"
	// JournalEpochFile holds the epoch of the journal the machine expects.
	// It outlives the journal: finding it without a matching JournalFile
	// means the journal was lost.
	JournalEpochFile = "journal.epoch"
)

// FileJournal is a daemon.Journal in a directory: an append-only JSON-lines
// file, fsynced on every write, beside an epoch marker that detects its loss.
// It is used from one goroutine (its machine's loop).
type FileJournal struct {
	dir    string
	f      *os.File
	mem    *daemon.MemoryJournal
	epoch  uint64
	lostAt time.Time
}

var _ daemon.Journal = (*FileJournal)(nil)

type journalHeader struct {
	V      int       `json:"v"`
	Epoch  uint64    `json:"epoch"`
	LostAt time.Time `json:"lost_at,omitzero"`
}

type journalRecord struct {
	ID         string          `json:"id"`
	Deleted    bool            `json:"deleted,omitempty"`
	Kind       string          `json:"kind,omitempty"`
	RetrySafe  bool            `json:"retry_safe,omitempty"`
	State      string          `json:"state,omitempty"`
	Result     json.RawMessage `json:"result,omitempty"`
	Error      string          `json:"error,omitempty"`
	Deadline   time.Time       `json:"deadline,omitzero"`
	ReceivedAt time.Time       `json:"received_at,omitzero"`
	FinishedAt time.Time       `json:"finished_at,omitzero"`
}

// OpenFileJournal opens the journal in dir at now. A first open creates an
// empty journal and its epoch marker. When the marker names a journal that
// is missing, belongs to another epoch, or is corrupt before its last line,
// the journal was lost: OpenFileJournal starts a new, empty one with the next
// epoch and LostAt reports now from then on (also after later opens). A torn
// last line (a Put that never returned) is dropped.
func OpenFileJournal(dir string, now time.Time) (*FileJournal, error) {
	j := &FileJournal{dir: dir, mem: daemon.NewMemoryJournal()}
	marker, hasMarker, err := readEpoch(filepath.Join(dir, JournalEpochFile))
	if err != nil {
		return nil, err
	}
	hdr, records, clean, err := readJournal(filepath.Join(dir, JournalFile))
	switch {
	case errors.Is(err, fs.ErrNotExist) && !hasMarker:
		// Fresh machine.
		return j, j.rewrite(journalHeader{V: 1, Epoch: 1})
	case errors.Is(err, fs.ErrNotExist):
		return j, j.rewrite(journalHeader{V: 1, Epoch: marker + 1, LostAt: now})
	case err != nil:
		return nil, err
	case hasMarker && hdr.Epoch != marker, !clean:
		return j, j.rewrite(journalHeader{V: 1, Epoch: max(marker, hdr.Epoch) + 1, LostAt: now})
	}
	for _, r := range records {
		if r.Deleted {
			_ = j.mem.Delete(r.ID)
			continue
		}
		e, err := r.entry()
		if err != nil {
			return j, j.rewrite(journalHeader{V: 1, Epoch: max(marker, hdr.Epoch) + 1, LostAt: now})
		}
		_ = j.mem.Put(e)
	}
	// Compact on every open: the file then holds exactly the live entries.
	return j, j.rewrite(hdr)
}

// readEpoch reads the epoch marker; ok is false when it does not exist.
func readEpoch(path string) (epoch uint64, ok bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	epoch, err = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, false, fmt.Errorf("%s: not an epoch: %w", path, err)
	}
	return epoch, true, nil
}

// readJournal reads the header and records. clean is false when a line other
// than the last does not parse (a torn last line is dropped silently).
func readJournal(path string) (hdr journalHeader, records []journalRecord, clean bool, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return hdr, nil, false, err
	}
	lines := bytes.Split(b, []byte("\n"))
	if len(lines) > 0 && len(lines[len(lines)-1]) == 0 {
		lines = lines[:len(lines)-1]
	}
	if len(lines) == 0 || json.Unmarshal(lines[0], &hdr) != nil || hdr.V != 1 {
		return hdr, nil, false, nil
	}
	for i, l := range lines[1:] {
		var r journalRecord
		if err := json.Unmarshal(l, &r); err != nil || r.ID == "" {
			if i == len(lines)-2 && !bytes.HasSuffix(b, []byte("\n")) {
				break // torn last write
			}
			return hdr, nil, false, nil
		}
		records = append(records, r)
	}
	return hdr, records, true, nil
}

func (r *journalRecord) entry() (daemon.Entry, error) {
	st, ok := gatewayv1.CommandState_value[r.State]
	if !ok {
		return daemon.Entry{}, fmt.Errorf("unknown state %q", r.State)
	}
	e := daemon.Entry{
		CommandID:  r.ID,
		Kind:       r.Kind,
		RetrySafe:  r.RetrySafe,
		State:      gatewayv1.CommandState(st),
		Error:      r.Error,
		Deadline:   r.Deadline,
		ReceivedAt: r.ReceivedAt,
		FinishedAt: r.FinishedAt,
	}
	if len(r.Result) > 0 {
		e.Result = &gatewayv1.CommandResult{}
		if err := protojson.Unmarshal(r.Result, e.Result); err != nil {
			return daemon.Entry{}, err
		}
	}
	return e, nil
}

func recordOf(e daemon.Entry) (journalRecord, error) {
	r := journalRecord{
		ID:         e.CommandID,
		Kind:       e.Kind,
		RetrySafe:  e.RetrySafe,
		State:      e.State.String(),
		Error:      e.Error,
		Deadline:   e.Deadline,
		ReceivedAt: e.ReceivedAt,
		FinishedAt: e.FinishedAt,
	}
	if e.Result != nil {
		b, err := protojson.Marshal(e.Result)
		if err != nil {
			return r, err
		}
		r.Result = b
	}
	return r, nil
}

// rewrite writes a new journal file holding hdr and the live entries, then
// the epoch marker, and keeps the file open for appends.
func (j *FileJournal) rewrite(hdr journalHeader) error {
	if err := os.MkdirAll(j.dir, 0o700); err != nil {
		return err
	}
	j.epoch, j.lostAt = hdr.Epoch, hdr.LostAt
	var buf bytes.Buffer
	w := bufio.NewWriter(&buf)
	if err := json.NewEncoder(w).Encode(hdr); err != nil {
		return err
	}
	for _, e := range j.mem.Entries() {
		r, err := recordOf(e)
		if err != nil {
			return err
		}
		if err := json.NewEncoder(w).Encode(r); err != nil {
			return err
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	path := filepath.Join(j.dir, JournalFile)
	if err := writeFileSync(path, buf.Bytes(), 0o600); err != nil {
		return err
	}
	if err := writeFileSync(filepath.Join(j.dir, JournalEpochFile), []byte(strconv.FormatUint(hdr.Epoch, 10)+"\n"), 0o600); err != nil {
		return err
	}
	if j.f != nil {
		_ = j.f.Close()
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	j.f = f
	return nil
}

// writeFileSync writes b to path atomically (temporary file, fsync, rename).
func writeFileSync(path string, b []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func (j *FileJournal) append(r journalRecord) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if _, err := j.f.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	if err := j.f.Sync(); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	return nil
}

// Get implements daemon.Journal.
func (j *FileJournal) Get(commandID string) (daemon.Entry, bool) { return j.mem.Get(commandID) }

// Put implements daemon.Journal: the record is on disk (fsynced) when it
// returns nil.
func (j *FileJournal) Put(e daemon.Entry) error {
	r, err := recordOf(e)
	if err != nil {
		return err
	}
	if err := j.append(r); err != nil {
		return err
	}
	return j.mem.Put(e)
}

// Delete implements daemon.Journal.
func (j *FileJournal) Delete(commandID string) error {
	if _, ok := j.mem.Get(commandID); !ok {
		return nil
	}
	if err := j.append(journalRecord{ID: commandID, Deleted: true}); err != nil {
		return err
	}
	return j.mem.Delete(commandID)
}

// Entries implements daemon.Journal.
func (j *FileJournal) Entries() []daemon.Entry { return j.mem.Entries() }

// LostAt implements daemon.Journal.
func (j *FileJournal) LostAt() time.Time { return j.lostAt }

// Epoch returns the journal's epoch (1 for a machine that never lost it).
func (j *FileJournal) Epoch() uint64 { return j.epoch }

// Close closes the journal file.
func (j *FileJournal) Close() error {
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}
