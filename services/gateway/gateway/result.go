package gateway

import (
	"strconv"
	"unicode/utf8"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// appendResultJSON appends r encoded as protojson encodes it (the JSON
// names of its fields, fields at their zero value left out, int64 values
// as strings, int32 as numbers), up to the text's layout: the result is
// stored as jsonb, which keeps neither the key order nor the spaces, so the
// API answers the same JSON for it either way. It writes into one buffer,
// where protojson goes through reflection and allocates for every field of
// every GPU. TestResultJSONIsProtojsons compares the two over every field of
// CommandResult and the messages in it, so a field gateway.proto adds fails
// there until this encodes it.
func appendResultJSON(b []byte, r *gatewayv1.CommandResult) []byte {
	b = append(b, '{')
	sep := false
	if inv := r.GetInventory(); inv != nil {
		b = appendKey(b, &sep, "inventory")
		b = appendInventoryJSON(b, inv)
	}
	if s := r.GetOutput(); s != "" {
		b = appendKey(b, &sep, "output")
		b = appendJSONString(b, s)
	}
	return append(b, '}')
}

// resultJSONSize is about the length of r's JSON (appendResultJSON), its
// strings unescaped: the capacity of a buffer that holds it in one
// allocation, as a result seldom carries characters to escape.
func resultJSONSize(r *gatewayv1.CommandResult) int {
	n := 32 + len(r.GetOutput())
	if inv := r.GetInventory(); inv != nil {
		n += 128 + len(inv.GetHostname()) + len(inv.GetDriverVersion())
		for _, g := range inv.GetGpus() {
			n += 128 + len(g.GetUuid()) + len(g.GetModel()) + len(g.GetPciBusId())
		}
	}
	return n
}

// appendInventoryJSON appends inv as protojson encodes it (appendResultJSON).
func appendInventoryJSON(b []byte, inv *gatewayv1.Inventory) []byte {
	b = append(b, '{')
	sep := false
	if gpus := inv.GetGpus(); len(gpus) > 0 {
		b = appendKey(b, &sep, "gpus")
		b = append(b, '[')
		for i, g := range gpus {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendGPUJSON(b, g)
		}
		b = append(b, ']')
	}
	if s := inv.GetHostname(); s != "" {
		b = appendKey(b, &sep, "hostname")
		b = appendJSONString(b, s)
	}
	if n := inv.GetCpuCores(); n != 0 {
		b = appendKey(b, &sep, "cpuCores")
		b = strconv.AppendInt(b, int64(n), 10)
	}
	if n := inv.GetMemoryBytes(); n != 0 {
		b = appendKey(b, &sep, "memoryBytes")
		b = appendInt64JSON(b, n)
	}
	if s := inv.GetDriverVersion(); s != "" {
		b = appendKey(b, &sep, "driverVersion")
		b = appendJSONString(b, s)
	}
	return append(b, '}')
}

// appendGPUJSON appends g as protojson encodes it (appendResultJSON).
func appendGPUJSON(b []byte, g *gatewayv1.Gpu) []byte {
	b = append(b, '{')
	sep := false
	if n := g.GetIndex(); n != 0 {
		b = appendKey(b, &sep, "index")
		b = strconv.AppendInt(b, int64(n), 10)
	}
	if s := g.GetUuid(); s != "" {
		b = appendKey(b, &sep, "uuid")
		b = appendJSONString(b, s)
	}
	if s := g.GetModel(); s != "" {
		b = appendKey(b, &sep, "model")
		b = appendJSONString(b, s)
	}
	if n := g.GetMemoryBytes(); n != 0 {
		b = appendKey(b, &sep, "memoryBytes")
		b = appendInt64JSON(b, n)
	}
	if s := g.GetPciBusId(); s != "" {
		b = appendKey(b, &sep, "pciBusId")
		b = appendJSONString(b, s)
	}
	if g.GetHealthy() {
		b = appendKey(b, &sep, "healthy")
		b = append(b, "true"...)
	}
	return append(b, '}')
}

// appendKey appends the key name of an object's member, after a comma when
// *sep says a member came before, and sets *sep.
func appendKey(b []byte, sep *bool, name string) []byte {
	if *sep {
		b = append(b, ',')
	}
	*sep = true
	b = append(b, '"')
	b = append(b, name...)
	return append(b, '"', ':')
}

// appendInt64JSON appends n as protojson encodes an int64: a JSON string.
func appendInt64JSON(b []byte, n int64) []byte {
	b = append(b, '"')
	b = strconv.AppendInt(b, n, 10)
	return append(b, '"')
}

// appendJSONString appends s as a JSON string (RFC 8259): '"', '\' and the
// control characters below U+0020 escaped, everything else as it is. s is
// valid UTF-8 (proto3 strings are checked when decoded); an invalid byte
// would be written as U+FFFD, as protojson refuses to encode it.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && size == 1 {
				b = append(b, s[start:i]...)
				b = append(b, `\ufffd`...)
				i++
				start = i
				continue
			}
			i += size
			continue
		}
		if c >= 0x20 && c != '"' && c != '\\' {
			i++
			continue
		}
		b = append(b, s[start:i]...)
		switch c {
		case '"', '\\':
			b = append(b, '\\', c)
		case '\n':
			b = append(b, '\\', 'n')
		case '\t':
			b = append(b, '\\', 't')
		case '\r':
			b = append(b, '\\', 'r')
		default:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xF])
		}
		i++
		start = i
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
