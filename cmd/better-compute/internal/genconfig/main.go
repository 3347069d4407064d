// Command genconfig writes the configuration reference, docs/configuration.md,
// from the configuration structs and the fakedaemon's flags (`make
// generate`; `make generate-check` fails when the file differs from what
// this writes): every variable of every service's Config, of `better-compute
// dev`'s settings, of the telemetry settings every process reads and of the
// fakedaemon's flags, with its default, what reads it and what it means: the
// doc comment of the field that declares it, or the usage of the flag whose
// default it sets. It reads the structs by reflection (pkg/config.Vars) and
// their doc comments from the source of their packages (go/build finds
// them), and the flags from the fakedaemon's flag set (flags.Vars), so it
// needs the source tree and a go command, not a database.
//
// To document a new service, add its Config to readers; a command whose
// variables set the defaults of its flags adds them to its reader's flags,
// as the fakedaemon's flags.Vars lists its own.
//
// Usage: go run ./cmd/better-compute/internal/genconfig PATH
package main

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/pkg/tunnel"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/controllers/controllers"
	fakedaemonflags "github.com/better-compute/better-compute/services/fakedaemon/flags"
	"github.com/better-compute/better-compute/services/gateway/gateway"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// readers are what reads the environment, and from which structs: every
// service its Config and, through telemetry.Setup and SetupMetrics,
// telemetry.Settings and MetricsSettings, and service.Profiling; the
// fakedaemon the variables of its flags too.
var readers = []struct {
	name  string
	types []reflect.Type
	flags []fakedaemonflags.Var
}{
	{api.Name, []reflect.Type{reflect.TypeFor[api.Config](), reflect.TypeFor[telemetry.Settings](), reflect.TypeFor[telemetry.MetricsSettings](), reflect.TypeFor[service.Profiling]()}, nil},
	{joinservice.Name, []reflect.Type{reflect.TypeFor[joinservice.Config](), reflect.TypeFor[telemetry.Settings](), reflect.TypeFor[telemetry.MetricsSettings](), reflect.TypeFor[service.Profiling]()}, nil},
	{gateway.Name, []reflect.Type{reflect.TypeFor[gateway.Config](), reflect.TypeFor[telemetry.Settings](), reflect.TypeFor[telemetry.MetricsSettings](), reflect.TypeFor[service.Profiling]()}, nil},
	{scheduler.Name, []reflect.Type{reflect.TypeFor[scheduler.Config](), reflect.TypeFor[telemetry.Settings](), reflect.TypeFor[telemetry.MetricsSettings](), reflect.TypeFor[service.Profiling]()}, nil},
	{controllers.Name, []reflect.Type{reflect.TypeFor[controllers.Config](), reflect.TypeFor[telemetry.Settings](), reflect.TypeFor[telemetry.MetricsSettings](), reflect.TypeFor[service.Profiling]()}, nil},
	{"dev", []reflect.Type{reflect.TypeFor[cli.DevSettings](), reflect.TypeFor[cli.DevLog]()}, nil},
	{"fakedaemon", []reflect.Type{reflect.TypeFor[telemetry.Settings]()}, fakedaemonflags.Vars()},
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: genconfig PATH")
		os.Exit(2)
	}
	if err := write(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "genconfig:", err)
		os.Exit(1)
	}
}

// row is one line of the table: a variable as one field declares it, and
// who reads it with which default.
type row struct {
	v        config.Var
	doc      string
	readers  []string
	defaults []string // per reader
}

func write(path string) error {
	docs := docReader{}
	var rows []*row
	byField := map[string]*row{}
	perReader := map[string][]string{}
	for _, r := range readers {
		for _, fv := range r.flags {
			rw, err := flagRow(fv)
			if err != nil {
				return err
			}
			rw.readers, rw.defaults = []string{r.name}, []string{rw.v.Default}
			rows = append(rows, rw)
			perReader[r.name] = append(perReader[r.name], fv.Name)
		}
		for _, t := range r.types {
			for _, v := range config.Vars(t) {
				key := v.Owner.PkgPath() + "." + v.Owner.Name() + "." + v.Field
				rw := byField[key]
				if rw == nil {
					doc, err := docs.field(v.Owner, v.Field)
					if err != nil {
						return err
					}
					rw = &row{v: v, doc: doc}
					byField[key] = rw
					rows = append(rows, rw)
				}
				rw.readers = append(rw.readers, r.name)
				rw.defaults = append(rw.defaults, v.Default)
				if !slices.Contains(perReader[r.name], v.Name) {
					perReader[r.name] = append(perReader[r.name], v.Name)
				}
			}
		}
	}
	slices.SortStableFunc(rows, func(a, b *row) int { return strings.Compare(a.v.Name, b.v.Name) })

	var b bytes.Buffer
	b.WriteString(header)
	b.WriteString("| variable | default | read by | type | meaning |\n| --- | --- | --- | --- | --- |\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s |\n", r.v.Name, defaults(r), strings.Join(r.readers, ", "),
			typeName(r.v), cell(r.doc))
	}
	b.WriteString("\n## By service\n\n")
	for _, r := range readers {
		names := perReader[r.name]
		for i, n := range names {
			names[i] = "`" + strings.TrimPrefix(n, config.Prefix) + "`"
		}
		fmt.Fprintf(&b, "- **%s**: %s\n", r.name, strings.Join(names, ", "))
	}
	writeFixedLimits(&b)
	return os.WriteFile(path, b.Bytes(), 0o644)
}

// writeFixedLimits writes the section on the limits that no setting
// changes, from the constants that set them.
func writeFixedLimits(b *bytes.Buffer) {
	fmt.Fprintf(b, `
## Fixed limits

These are constants of the code, not settings.

- **Message size**: every message a Connect handler of the API, JoinService or the gateway reads (every unary
  request and every message of every stream, the gateway's sessions included) is at most %s
  (`+"`service.MaxMessageBytes`"+`), after gzip too; inflating stops there. A larger unary request is refused
  with `+"`ResourceExhausted`"+` (its message says "larger than configured max %d"); over the Connect protocol
  its HTTP status is 413 (Content Too Large), not 429, so that it is not taken for a rate limit, and a Connect
  client still sees `+"`ResourceExhausted`"+` (from the error in the body). A larger message in a stream ends
  that stream with `+"`ResourceExhausted`"+` (HTTP 200, the code at the stream's end, as in gRPC); the
  server's other calls and streams go on.
- **Tunnel frames**: one message of a tunnel (a node's shell or a sandbox's SSH) is at most %s
  (`+"`tunnel.MaxMessageBytes`"+`).
`, bytesText(service.MaxMessageBytes), service.MaxMessageBytes, bytesText(tunnel.MaxMessageBytes))
}

// bytesText writes n bytes in KiB or MiB when it is a whole number of
// them, and adds the exact count.
func bytesText(n int) string {
	switch {
	case n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB (%d bytes)", n>>20, n)
	case n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB (%d bytes)", n>>10, n)
	default:
		return fmt.Sprintf("%d bytes", n)
	}
}

const header = `# Configuration

Generated from the configuration structs and the fakedaemon's flags by ` + "`make generate`" + `
(cmd/better-compute/internal/genconfig); do not edit. Each service reads its configuration from the environment
into one struct, its package's ` + "`Config`" + `, whose fields declare the variables, their defaults and their checks;
the settings several services share are declared once in ` + "`pkg/service`" + ` and embedded, and ` + "`pkg/config`" + ` reads
them all (docs/architecture.md, "Services"). The **fakedaemon**'s variables set the defaults of its flags
(` + "`services/fakedaemon/flags`" + `, ` + "`fakedaemon --help`" + `), each flag first in the meaning of its variable; a flag
given on the command line wins.

Every variable is named ` + "`BETTER_COMPUTE_*`" + `. An unset or empty variable takes its default; a value that does not
parse, or a duration that must be positive and is not, stops the service at start with a message naming the
variable. **dev** is ` + "`better-compute dev`" + `, which reads its four deployment settings from its configuration
file (` + "`--config`" + `) too, the environment over the file. The CLI's own variables (` + "`BETTER_COMPUTE_URL`" + `,
` + "`_TOKEN`" + `, ` + "`_TENANT`" + `, ` + "`_CONFIG`" + ` …) are in [cli.md](cli.md), how the fakedaemon uses its flags in
[fakedaemon.md](fakedaemon.md). OpenTelemetry's own variables (` + "`OTEL_EXPORTER_OTLP_ENDPOINT`" + ` …) turn on the
export of traces.

`

// flagRow is the row of a variable that sets the default of a flag (or,
// without a flag, is read on its own): its meaning is the flag's usage,
// after the flag as `--help` shows it.
func flagRow(fv fakedaemonflags.Var) (*row, error) {
	types := map[string]reflect.Type{"string": reflect.TypeFor[string](), "bool": reflect.TypeFor[bool](),
		"int": reflect.TypeFor[int](), "duration": reflect.TypeFor[time.Duration]()}
	t, ok := types[fv.Type]
	if !ok {
		return nil, fmt.Errorf("%s: flag type %q has no name here (add it to flagRow)", fv.Name, fv.Type)
	}
	def := fv.Default
	if t == reflect.TypeFor[time.Duration]() {
		def = shortDuration(def)
	}
	doc := fv.Usage
	if fv.Flag != "" {
		doc = "`" + strings.TrimSpace("--"+fv.Flag+" "+fv.Placeholder) + "`: " + doc
	}
	if !strings.HasSuffix(doc, ".") {
		doc += "."
	}
	return &row{v: config.Var{Name: fv.Name, Default: def, Type: t}, doc: doc}, nil
}

// shortDuration drops the zero units time.Duration.String ends with:
// 2m0s is 2m, 1h0m0s 1h; 0s stays.
func shortDuration(d string) string {
	for _, unit := range []string{"0s", "0m"} {
		if rest, ok := strings.CutSuffix(d, unit); ok && (strings.HasSuffix(rest, "h") || strings.HasSuffix(rest, "m")) {
			d = rest
		}
	}
	return d
}

// defaults says a row's default: the most readers' (on a tie, a default
// over none), then the others' by reader.
func defaults(r *row) string {
	show := func(d string) string {
		switch {
		case d != "":
			return "`" + d + "`"
		case r.v.Type.Kind() == reflect.Bool:
			return "`false`"
		default:
			return "(none)"
		}
	}
	count := map[string]int{}
	common := r.defaults[0]
	for _, d := range r.defaults {
		count[d]++
		if count[d] > count[common] || (count[d] == count[common] && common == "") {
			common = d
		}
	}
	parts := []string{show(common)}
	for i, d := range r.defaults {
		if d != common {
			parts = append(parts, r.readers[i]+": "+show(d))
		}
	}
	return strings.Join(parts, "; ")
}

// typeName says what a variable's value is.
func typeName(v config.Var) string {
	switch {
	case v.Type == reflect.TypeFor[time.Duration]() && v.Positive:
		return "duration > 0"
	case v.Type == reflect.TypeFor[time.Duration]():
		return "duration"
	case v.Type.Kind() == reflect.Bool:
		return "true or false"
	case v.Type == reflect.TypeFor[telemetry.Level]():
		return "debug, info, warn or error"
	case v.Type == reflect.TypeFor[telemetry.Exporter]():
		return "prometheus, otlp or none"
	case v.Type.Kind() == reflect.String:
		return "string"
	default:
		return "whole number"
	}
}

// cell is a doc comment as the meaning of a variable: one line, the
// field's name dropped ("Listen is the address…" → "The address…"), pipes
// escaped.
func cell(doc string) string {
	doc = strings.Join(strings.Fields(doc), " ")
	doc = strings.ReplaceAll(doc, "|", `\|`)
	r, size := utf8.DecodeRuneInString(doc)
	return string(unicode.ToUpper(r)) + doc[size:]
}

// docReader reads the doc comments of struct fields from their packages'
// source.
type docReader map[string][]*ast.File

// field returns the doc comment of field in the struct type t, without
// its leading name ("X is", "X are", "X").
func (d docReader) field(t reflect.Type, field string) (string, error) {
	files, err := d.files(t.PkgPath())
	if err != nil {
		return "", err
	}
	for _, f := range files {
		for _, decl := range f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok {
				continue
			}
			for _, spec := range gd.Specs {
				ts, ok := spec.(*ast.TypeSpec)
				if !ok || ts.Name.Name != t.Name() {
					continue
				}
				st, ok := ts.Type.(*ast.StructType)
				if !ok {
					return "", fmt.Errorf("%s is not a struct", t)
				}
				for _, fl := range st.Fields.List {
					for _, n := range fl.Names {
						if n.Name == field {
							return trimName(fl.Doc.Text(), field, t)
						}
					}
				}
			}
		}
	}
	return "", fmt.Errorf("no field %s in the source of %s", field, t)
}

func trimName(doc, field string, t reflect.Type) (string, error) {
	for _, prefix := range []string{field + " is ", field + " are ", field + " "} {
		if rest, ok := strings.CutPrefix(doc, prefix); ok {
			return rest, nil
		}
	}
	return "", fmt.Errorf("%s.%s: its doc comment must begin with its name, got %q", t, field, doc)
}

// files parses the Go files of the package at pkgPath.
func (d docReader) files(pkgPath string) ([]*ast.File, error) {
	if fs, ok := d[pkgPath]; ok {
		return fs, nil
	}
	wd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	pkg, err := build.Default.Import(pkgPath, wd, 0)
	if err != nil {
		return nil, fmt.Errorf("find the source of %s: %w", pkgPath, err)
	}
	fset := token.NewFileSet()
	var fs []*ast.File
	for _, name := range pkg.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(pkg.Dir, name), nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		fs = append(fs, f)
	}
	d[pkgPath] = fs
	return fs, nil
}
