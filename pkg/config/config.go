// Package config reads a better-compute service's configuration from the
// environment into the service's typed Config struct, and lists the
// variables such a struct reads, from which docs/configuration.md is
// generated (docs/architecture.md, "Services": one Config per service).
//
// A field is a variable when it has an env tag; its name is Prefix and the
// tag's name (env:"LISTEN" is BETTER_COMPUTE_LISTEN). Its default tag is
// the value taken when the variable is unset or empty; fields without a
// default stay zero, and the field's doc comment says what zero means. A
// field with a default tag and no env tag is a setting of Go callers only,
// which SetDefaults fills like the others.
// Options after the name check the value: env:"LEASE_TTL,positive" refuses
// zero and negative values. Struct fields (embedded or named, not
// pointers) are read recursively, so settings several services share live
// in one struct that each embeds (pkg/service: Database, NATS, PKI, …). A
// struct field's default tag overrides the defaults of the variables inside
// it for this embedding only: default:"PKI_DIR=" makes PKI_DIR default to
// empty there.
//
// Field types: string, bool (strconv.ParseBool), int kinds,
// time.Duration (time.ParseDuration) and any type whose pointer implements
// encoding.TextUnmarshaler.
//
// To add a variable, add a field with its env and default tags and a doc
// comment to the service's Config (or to a shared struct), and run `make
// generate`. Go callers (tests, pkg/devstack) build Configs directly; the
// service's New calls SetDefaults, so that a zero field means its default
// there too.
package config

import (
	"encoding"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// Prefix starts every variable's name: the product's prefix, which the CLI
// reads too (BETTER_COMPUTE_URL, BETTER_COMPUTE_TOKEN, …).
const Prefix = "BETTER_COMPUTE_"

// Error is a variable whose value was refused: Name is the variable (with
// Prefix), Err what is wrong with it.
type Error struct {
	Name string
	Err  error
}

// Error returns "NAME: what is wrong".
func (e *Error) Error() string { return e.Name + ": " + e.Err.Error() }

// Unwrap returns what is wrong.
func (e *Error) Unwrap() error { return e.Err }

// Var is one variable of a Config struct, as Vars lists it.
type Var struct {
	// Name is the variable's full name, Prefix included.
	Name string
	// Default is the value taken when the variable is unset or empty, as
	// written in the tag ("" when there is none).
	Default string
	// Positive is true when zero and negative values are refused.
	Positive bool
	// Type is the field's type.
	Type reflect.Type
	// Owner is the struct type that declares the field, and Field the
	// field's name in it: where its doc comment is.
	Owner reflect.Type
	Field string
}

// Load sets the variables of the struct dst points to from getenv (usually
// os.Getenv): a variable that is unset or empty takes its default, and
// leaves its field as it is when it has none; a zero field with a default
// and no variable takes its default. It
// returns every refused value, each an *Error, joined (errors.Join); fields
// of the others are set. It panics when dst is not a pointer to a struct or
// a tag names a type it cannot read (a programming error, caught by the
// service's tests).
func Load(dst any, getenv func(string) string) error {
	var errs []error
	walk(structValue(dst), nil, func(f field) {
		if f.v.Name == "" {
			setDefault(f)
			return
		}
		raw := getenv(f.v.Name)
		if raw == "" {
			raw = f.v.Default
		}
		if raw == "" {
			return
		}
		if err := set(f.val, raw); err != nil {
			errs = append(errs, &Error{Name: f.v.Name, Err: err})
			return
		}
		if f.v.Positive && f.val.Int() <= 0 {
			errs = append(errs, &Error{Name: f.v.Name, Err: fmt.Errorf("must be positive, got %q", raw)})
		}
	})
	return errors.Join(errs...)
}

// SetDefaults sets every zero field of the struct dst points to that has a
// default tag to that default: what a Go caller's zero field means. It panics like Load,
// and when a default tag does not parse.
func SetDefaults(dst any) { walk(structValue(dst), nil, setDefault) }

func setDefault(f field) {
	if f.v.Default == "" || !f.val.IsZero() {
		return
	}
	if err := set(f.val, f.v.Default); err != nil {
		panic(fmt.Sprintf("config: default of %s.%s: %v", f.v.Owner, f.v.Field, err))
	}
}

// Vars lists the variables of the struct type t (a struct or a pointer to
// one) in field order, embedded structs' where they are embedded. It
// panics like Load.
func Vars(t reflect.Type) []Var {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var vars []Var
	walk(reflect.New(t).Elem(), nil, func(f field) {
		if f.v.Name != "" {
			vars = append(vars, f.v)
		}
	})
	return vars
}

// field is a variable field met by walk, with its settable value.
type field struct {
	v   Var
	val reflect.Value
}

func structValue(dst any) reflect.Value {
	v := reflect.ValueOf(dst)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		panic(fmt.Sprintf("config: want a pointer to a struct, got %T", dst))
	}
	return v.Elem()
}

var (
	durationType      = reflect.TypeFor[time.Duration]()
	textUnmarshalType = reflect.TypeFor[encoding.TextUnmarshaler]()
)

// walk calls fn for every variable field of the struct v, overrides
// replacing the defaults of the names they hold.
func walk(v reflect.Value, overrides map[string]string, fn func(field)) {
	t := v.Type()
	for i := range t.NumField() {
		sf := t.Field(i)
		tag, ok := sf.Tag.Lookup("env")
		if !ok {
			_, hasDefault := sf.Tag.Lookup("default")
			switch {
			case sf.Type.Kind() == reflect.Struct && (sf.IsExported() || sf.Anonymous) && !readable(sf.Type):
				walk(v.Field(i), mergeOverrides(overrides, sf), fn)
			case hasDefault && sf.IsExported() && readable(sf.Type):
				// A setting of Go callers only: no variable, a default.
				fn(field{v: Var{Default: sf.Tag.Get("default"), Type: sf.Type, Owner: t, Field: sf.Name}, val: v.Field(i)})
			}
			continue
		}
		if !sf.IsExported() {
			panic(fmt.Sprintf("config: %s.%s: an env field must be exported", t, sf.Name))
		}
		if !readable(sf.Type) {
			panic(fmt.Sprintf("config: %s.%s: cannot read a %s", t, sf.Name, sf.Type))
		}
		name, opts, _ := strings.Cut(tag, ",")
		def := sf.Tag.Get("default")
		if o, ok := overrides[name]; ok {
			def = o
		}
		f := Var{Name: Prefix + name, Default: def, Type: sf.Type, Owner: t, Field: sf.Name}
		for opt := range strings.SplitSeq(opts, ",") {
			switch opt {
			case "":
			case "positive":
				if sf.Type.Kind() < reflect.Int || sf.Type.Kind() > reflect.Int64 {
					panic(fmt.Sprintf("config: %s.%s: positive needs a signed number", t, sf.Name))
				}
				f.Positive = true
			default:
				panic(fmt.Sprintf("config: %s.%s: unknown option %q", t, sf.Name, opt))
			}
		}
		fn(field{v: f, val: v.Field(i)})
	}
}

// mergeOverrides adds the overrides of the struct field sf's default tag
// ("NAME=value;NAME=value") to the outer ones, which win.
func mergeOverrides(outer map[string]string, sf reflect.StructField) map[string]string {
	tag := sf.Tag.Get("default")
	if tag == "" {
		return outer
	}
	m := map[string]string{}
	for kv := range strings.SplitSeq(tag, ";") {
		k, val, ok := strings.Cut(kv, "=")
		if !ok {
			panic(fmt.Sprintf("config: field %s: default overrides are NAME=value;…, got %q", sf.Name, tag))
		}
		m[k] = val
	}
	for k, val := range outer {
		m[k] = val
	}
	return m
}

// readable reports whether set can parse into a field of type t.
func readable(t reflect.Type) bool {
	if reflect.PointerTo(t).Implements(textUnmarshalType) {
		return true
	}
	switch t.Kind() {
	case reflect.String, reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return true
	}
	return false
}

// set parses raw into v; its errors say what was wanted and what came.
func set(v reflect.Value, raw string) error {
	if u, ok := v.Addr().Interface().(encoding.TextUnmarshaler); ok {
		return u.UnmarshalText([]byte(raw))
	}
	switch {
	case v.Type() == durationType:
		d, err := time.ParseDuration(raw)
		if err != nil {
			return fmt.Errorf("want a duration such as 30s or 5m, got %q", raw)
		}
		v.SetInt(int64(d))
	case v.Kind() == reflect.String:
		v.SetString(raw)
	case v.Kind() == reflect.Bool:
		b, err := strconv.ParseBool(raw)
		if err != nil {
			return fmt.Errorf("want true or false, got %q", raw)
		}
		v.SetBool(b)
	default: // the int kinds, per readable
		n, err := strconv.ParseInt(raw, 10, v.Type().Bits())
		if err != nil {
			return fmt.Errorf("want a whole number, got %q", raw)
		}
		v.SetInt(n)
	}
	return nil
}
