package agent

import (
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
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
)

// Journal file names inside a machine's directory.
const (
	// JournalFile holds the journal: a header line, then one JSON record
	// per Put or Delete, appended. It is created by the first write, so a
	// machine that never received a command has none.
	JournalFile = "journal.jsonl"
	// JournalEpochFile holds the epoch of the journal the machine expects.
	// It is written when a journal of a new epoch is created and outlives
	// the journal: finding it without a matching JournalFile means the
	// journal was lost. A machine's first journal, made with its identity,
	// has none: the identity (NodeFile) stands for epoch 1.
	JournalEpochFile = "journal.epoch"
)

// compactSlack is how many superfluous lines (replaced or deleted entries)
// beyond one per live entry the journal file may hold before it is
// rewritten with only the live entries.
const compactSlack = 64

// FileJournal is a daemon.Journal in a directory: an append-only JSON-lines
// file beside an epoch marker that detects its loss. A Put is fsynced before
// it returns; a Delete is not (a forgotten Delete only brings back a finished
// entry, which is pruned again). Opening writes nothing unless a loss, a
// torn tail or compaction calls for it; in a bare directory the file appears
// with the first Put. The marker is written once per epoch. It is used from
// one goroutine (its machine's loop).
type FileJournal struct {
	dir    string
	f      *os.File // nil until the journal file exists
	mem    *daemon.MemoryJournal
	epoch  uint64
	lostAt time.Time
	marked bool // the marker (JournalEpochFile, or the identity) names epoch
	lines  int  // records in the file
	closed bool
}

var _ daemon.Journal = (*FileJournal)(nil)

type journalHeader struct {
	V      int       `json:"v"`
	Epoch  uint64    `json:"epoch"`
	LostAt time.Time `json:"lost_at,omitzero"`
}

type journalRecord struct {
	ID        string `json:"id"`
	Deleted   bool   `json:"deleted,omitempty"`
	Kind      string `json:"kind,omitempty"`
	RetrySafe bool   `json:"retry_safe,omitempty"`
	State     string `json:"state,omitempty"`
	// ResultPB is the result in protobuf's binary form (base64 in the
	// JSON); Result, its protojson form, is how journals written before it
	// hold it and is still read.
	ResultPB   []byte          `json:"result_pb,omitempty"`
	Result     json.RawMessage `json:"result,omitempty"`
	Error      string          `json:"error,omitempty"`
	Deadline   time.Time       `json:"deadline,omitzero"`
	ReceivedAt time.Time       `json:"received_at,omitzero"`
	FinishedAt time.Time       `json:"finished_at,omitzero"`
	// Runs and Interrupted are daemon.Entry's (absent in journals written
	// before them: Runs reads as 0).
	Runs        int    `json:"runs,omitempty"`
	Interrupted string `json:"interrupted,omitempty"`
}

// OpenFileJournal opens the journal in dir at now. A first open writes
// nothing: the journal file and its epoch marker appear with the first Put.
// When the marker names a journal that is missing, belongs to another epoch,
// or is corrupt before its last line, the journal was lost: OpenFileJournal
// writes a new, empty one with the next epoch and LostAt reports now from
// then on (also after later opens). A torn last line (a Put that never
// returned) is dropped, as is a journal without a marker whose header is
// torn (its first Put never returned). The file is compacted when it holds
// many replaced or deleted entries.
func OpenFileJournal(dir string, now time.Time) (*FileJournal, error) {
	return openFileJournal(dir, now, false)
}

// initFileJournal makes an empty journal of epoch 1 in dir, durably, and
// removes any epoch marker of an earlier identity. A machine calls it before
// saving its identity, which from then on stands for the journal's epoch
// marker: see openFileJournal.
func initFileJournal(dir string) error {
	if err := os.Remove(filepath.Join(dir, JournalEpochFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	j := &FileJournal{dir: dir, epoch: 1}
	hdr, err := j.header()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, JournalFile), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(hdr); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// openFileJournal is OpenFileJournal; joined says that initFileJournal made
// the epoch-1 journal before the identity was saved, so that without a
// marker the journal's epoch is 1 and its absence is a loss.
func openFileJournal(dir string, now time.Time, joined bool) (*FileJournal, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	j := &FileJournal{dir: dir, mem: daemon.NewMemoryJournal(), epoch: 1}
	if err := j.open(now, joined); err != nil {
		_ = j.Close()
		return nil, err
	}
	return j, nil
}

func (j *FileJournal) open(now time.Time, joined bool) error {
	dir := j.dir
	marker, hasMarker, err := readEpoch(filepath.Join(dir, JournalEpochFile))
	if err != nil {
		return err
	}
	if !hasMarker && joined {
		marker, hasMarker = 1, true
	}
	jf, err := readJournal(filepath.Join(dir, JournalFile))
	switch {
	case errors.Is(err, fs.ErrNotExist) && !hasMarker, err == nil && !hasMarker && !jf.header:
		// Fresh machine, or its first Put never returned.
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return j.lose(marker+1, now)
	case err != nil:
		return err
	case hasMarker && jf.hdr.Epoch != marker, !jf.clean:
		return j.lose(max(marker, jf.hdr.Epoch)+1, now)
	}
	j.epoch, j.lostAt, j.marked = jf.hdr.Epoch, jf.hdr.LostAt, hasMarker
	for _, r := range jf.records {
		if r.Deleted {
			_ = j.mem.Delete(r.ID)
			continue
		}
		e, err := r.entry()
		if err != nil {
			return j.lose(max(marker, jf.hdr.Epoch)+1, now)
		}
		_ = j.mem.Put(e)
	}
	j.lines = len(jf.records)
	if jf.torn || !j.marked || j.bloated() {
		// Drop the torn line before appending after it, write the marker
		// of a journal whose first Put crashed before it, or compact.
		return j.rewrite()
	}
	f, err := os.OpenFile(filepath.Join(dir, JournalFile), os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	j.f = f
	return nil
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

// journalFile is what readJournal found.
type journalFile struct {
	hdr     journalHeader
	records []journalRecord
	header  bool // the header line parses
	clean   bool // every line but a torn last one parses
	torn    bool // the last line was torn and dropped
}

// readJournal reads the header and records of the journal file.
func readJournal(path string) (jf journalFile, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return jf, err
	}
	lines := bytes.Split(b, []byte("\n"))
	if len(lines) > 0 && len(lines[len(lines)-1]) == 0 {
		lines = lines[:len(lines)-1]
	}
	if len(lines) == 0 || json.Unmarshal(lines[0], &jf.hdr) != nil || jf.hdr.V != 1 || jf.hdr.Epoch == 0 {
		return jf, nil
	}
	jf.header = true
	for i, l := range lines[1:] {
		var r journalRecord
		if err := json.Unmarshal(l, &r); err != nil || r.ID == "" {
			if i == len(lines)-2 && !bytes.HasSuffix(b, []byte("\n")) {
				jf.torn = true // torn last write
				break
			}
			return jf, nil
		}
		jf.records = append(jf.records, r)
	}
	jf.clean = true
	return jf, nil
}

func (r *journalRecord) entry() (daemon.Entry, error) {
	st, ok := gatewayv1.CommandState_value[r.State]
	if !ok {
		return daemon.Entry{}, fmt.Errorf("unknown state %q", r.State)
	}
	e := daemon.Entry{
		CommandID:   r.ID,
		Kind:        r.Kind,
		RetrySafe:   r.RetrySafe,
		State:       gatewayv1.CommandState(st),
		Error:       r.Error,
		Deadline:    r.Deadline,
		ReceivedAt:  r.ReceivedAt,
		FinishedAt:  r.FinishedAt,
		Runs:        r.Runs,
		Interrupted: r.Interrupted,
	}
	switch {
	case len(r.ResultPB) > 0:
		e.Result = &gatewayv1.CommandResult{}
		if err := proto.Unmarshal(r.ResultPB, e.Result); err != nil {
			return daemon.Entry{}, err
		}
	case len(r.Result) > 0:
		e.Result = &gatewayv1.CommandResult{}
		if err := protojson.Unmarshal(r.Result, e.Result); err != nil {
			return daemon.Entry{}, err
		}
	}
	return e, nil
}

func recordOf(e daemon.Entry) (journalRecord, error) {
	r := journalRecord{
		ID:          e.CommandID,
		Kind:        e.Kind,
		RetrySafe:   e.RetrySafe,
		State:       e.State.String(),
		Error:       e.Error,
		Deadline:    e.Deadline,
		ReceivedAt:  e.ReceivedAt,
		FinishedAt:  e.FinishedAt,
		Runs:        e.Runs,
		Interrupted: e.Interrupted,
	}
	if e.Result != nil {
		// Binary: protojson was a third of a journal write's CPU.
		b, err := proto.Marshal(e.Result)
		if err != nil {
			return r, err
		}
		r.ResultPB = b
	}
	return r, nil
}

// lose starts an empty journal of epoch at now, the time the loss was found.
// It is written at once (journal, then marker), so that later opens remember
// the loss.
func (j *FileJournal) lose(epoch uint64, now time.Time) error {
	j.mem = daemon.NewMemoryJournal()
	j.epoch, j.lostAt, j.marked = epoch, now, false
	return j.rewrite()
}

func (j *FileJournal) header() ([]byte, error) {
	b, err := json.Marshal(journalHeader{V: 1, Epoch: j.epoch, LostAt: j.lostAt})
	return append(b, '\n'), err
}

// rewrite replaces the journal file by one holding the header and the live
// entries (atomically, fsynced), writes the epoch marker if it does not name
// this epoch yet, and keeps the file open for appends.
func (j *FileJournal) rewrite() error {
	buf, err := j.header()
	if err != nil {
		return err
	}
	entries := j.mem.Entries()
	for _, e := range entries {
		r, err := recordOf(e)
		if err != nil {
			return err
		}
		b, err := json.Marshal(r)
		if err != nil {
			return err
		}
		buf = append(append(buf, b...), '\n')
	}
	f, err := writeFileKeep(filepath.Join(j.dir, JournalFile), buf, 0o600)
	if err != nil {
		return err
	}
	if j.f != nil {
		_ = j.f.Close()
	}
	j.f, j.lines = f, len(entries)
	return j.mark()
}

// mark writes the epoch marker, once per epoch. It comes after the journal
// it names is on disk: a crash in between leaves a journal without a marker,
// which the next open adopts.
func (j *FileJournal) mark() error {
	if j.marked {
		return nil
	}
	if err := writeFileSync(filepath.Join(j.dir, JournalEpochFile), []byte(strconv.FormatUint(j.epoch, 10)+"\n"), 0o600); err != nil {
		return err
	}
	j.marked = true
	return nil
}

// create makes the journal file with its header and first record, fsyncs
// it, then writes the epoch marker. A crash before the fsync leaves at most a
// torn file without a marker: the next open starts fresh, which is right, as
// the Put never returned.
func (j *FileJournal) create(first []byte) error {
	hdr, err := j.header()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(j.dir, JournalFile), os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	if _, err := f.Write(append(hdr, first...)); err != nil {
		f.Close()
		return fmt.Errorf("journal: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("journal: %w", err)
	}
	if err := j.mark(); err != nil {
		f.Close()
		return fmt.Errorf("journal: %w", err)
	}
	j.f, j.lines = f, 1
	return nil
}

// writeFileSync writes b to path atomically (temporary file, fsync, rename).
func writeFileSync(path string, b []byte, mode os.FileMode) error {
	f, err := writeFileKeep(path, b, mode)
	if err != nil {
		return err
	}
	return f.Close()
}

// writeFileKeep is writeFileSync returning the file, open for writing at its
// end.
func writeFileKeep(path string, b []byte, mode os.FileMode) (*os.File, error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return nil, err
	}
	err = tmp.Chmod(mode)
	if err == nil {
		_, err = tmp.Write(b)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		tmp.Close()
		_ = os.Remove(tmp.Name())
		return nil, err
	}
	return tmp, nil
}

// append writes r, fsynced when durable; the first write creates the file.
func (j *FileJournal) append(r journalRecord, durable bool) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if j.f == nil {
		if j.closed {
			return fmt.Errorf("journal: %w", os.ErrClosed)
		}
		return j.create(b)
	}
	if _, err := j.f.Write(b); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	j.lines++
	if durable {
		if err := j.f.Sync(); err != nil {
			return fmt.Errorf("journal: %w", err)
		}
	}
	return nil
}

// bloated reports whether the file holds enough superfluous lines to be
// compacted.
func (j *FileJournal) bloated() bool { return j.lines > 2*j.mem.Len()+compactSlack }

// compact rewrites a bloated journal. A failure is not the caller's: the
// record it appended is already durable, so compaction is retried later.
func (j *FileJournal) compact() {
	if j.bloated() {
		_ = j.rewrite()
	}
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
	if err := j.append(r, true); err != nil {
		return err
	}
	_ = j.mem.Put(e)
	j.compact()
	return nil
}

// Delete implements daemon.Journal.
func (j *FileJournal) Delete(commandID string) error {
	if _, ok := j.mem.Get(commandID); !ok {
		return nil
	}
	if err := j.append(journalRecord{ID: commandID, Deleted: true}, false); err != nil {
		return err
	}
	_ = j.mem.Delete(commandID)
	j.compact()
	return nil
}

// Entries implements daemon.Journal.
func (j *FileJournal) Entries() []daemon.Entry { return j.mem.Entries() }

// LostAt implements daemon.Journal.
func (j *FileJournal) LostAt() time.Time { return j.lostAt }

// Epoch returns the journal's epoch (1 for a machine that never lost it).
func (j *FileJournal) Epoch() uint64 { return j.epoch }

// Close closes the journal file.
func (j *FileJournal) Close() error {
	j.closed = true
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}
