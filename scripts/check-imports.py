#!/usr/bin/env python3
"""keel's structure check, run by .ci/run: no import circles between the source files of any
crate, counted strictly, and keel-proxy's folders are floors (each room imports only rooms on
floors below it).

Imports are read as text, with comments, string literals and `#[cfg(test)]` modules left out (a
test may reach anywhere): `crate::a::b`, `super::a` and `self::a` paths and `use crate::{a::b,
c}` groups, and, in a module's own file, the bare paths that start with one of its child
modules (`report::write`, `use rows::Row`). The last rule is what makes the count strict: a
`mod.rs` that uses its children while they use it is a circle, so a parent holds only
declarations and the code that runs its children, and what the children share lives in a
child of its own below them. `mod x;` declarations are not imports, `pub(super)` names the
parent; re-exports (`pub use`, `pub(crate) use`) are not arrows of a circle (a facade is
allowed) but still count for the floors. A path is resolved to the longest module path that is
a file. Usage: python3 scripts/check-imports.py (from the repository root or anywhere); exits 1
and names each circle or upward import."""
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

# keel-proxy's floors, ground first; rooms on one line share a floor and must not import each
# other in a circle. A room imports only rooms on its own floor or below.
PROXY_FLOORS = [
    ["io", "codec", "metrics"],  # vocabulary with no I/O of its own: bytes, HTTP/1.1, counters
    ["future_size"],             # test-only: a future's size, for the rooms that hold them
    ["config"],                  # the file's types; parses and validates, reads no file
    ["tls"],                     # rustls setup from config's TLS types
    ["exchange"],                # the neutral request, response and errors
    ["policy"],                  # rate limits, rewrites, sticky: what a route does to a request
    ["upstream"],                # clusters, pools, the HTTP/1.1 client, health checks, probes
    ["route", "driver"],         # which cluster; the attempt driver
    ["leg"],                     # one try on one endpoint, per protocol
    ["forward"],                 # policy phases -> drive -> response phase
    ["observe"],                 # the request's record and the access log
    ["state"],                   # what the running proxy shares
    ["control"],                 # reloads, discovery, loading a configuration file
    ["admin"],                   # the admin listener
    ["front"],                   # HTTP/1.1, HTTP/2, HTTP/3, TCP front ends
    ["serve"],                   # sockets, workers, lifecycle
]


def code(path):
    t = open(path, encoding="utf-8", errors="replace").read()
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", t)
    if m:
        t = t[: m.start()]
    t = re.sub(r"//[^\n]*", "", t)
    t = re.sub(r"/\*.*?\*/", "", t, flags=re.S)
    t = re.sub(r'"(\\.|[^"\\])*"', '""', t)
    # `pub(crate)`, `pub(self)`, `pub(in crate::a)`: who may see an item, not an import.
    # `pub(super)` stays: an item written for its parent names it (see `paths`).
    t = re.sub(r"\bpub\s*\((?:crate|self|in\s[^)]*)\)", "pub", t)
    # `mod x;`: a declaration, not an import.
    return re.sub(r"(?m)^\s*(?:pub\s+)?mod\s+\w+\s*;", "", t)


REEXPORT = re.compile(r"(?m)^\s*pub\s+use\s[^;]*;")


def reexports_dropped(text):
    """`text` without its re-exports (`pub use ...;`, any visibility): a facade, not an arrow."""
    return REEXPORT.sub("", text)


def split_top(s):
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def paths(text, module=(), children=()):
    """Every `crate::...` path, with `{...}` groups expanded (nested ones too); `super::...` and
    `self::...` paths made absolute from `module` (the file's module path); and paths that
    start with one of `children` (the file's child modules), made absolute the same way."""
    out = []

    def expand(prefix, rest):
        rest = rest.strip()
        if not rest:
            return
        if rest.startswith("{"):
            inner = rest[1 : rest.rindex("}")]
            for p in split_top(inner):
                p = p.strip().split(" as ")[0].strip()
                if p == "self":
                    out.append(prefix)
                elif p:
                    expand(prefix, p)
            return
        m = re.match(r"(\w+)(::)?(.*)", rest, re.S)
        if not m:
            return
        name, more = m.group(1), m.group(3) if m.group(2) else ""
        if more.strip().startswith("{"):
            expand(prefix + [name], more)
        elif more and m.group(2):
            expand(prefix + [name], more)
        else:
            out.append(prefix + [name])

    # An item visible only to the parent (`pub(super)`) is written for it: an arrow to the
    # parent, so a child the parent uses shares nothing with it that way (keel writes
    # `pub(crate)` for what a folder's files share).
    if module and re.search(r"\bpub\s*\(\s*super\s*\)", text):
        out.append(list(module[:-1]))
    heads = r"crate::|self::|(?:super::)+"
    if children:
        heads += "|" + "|".join(re.escape(c) + "::" for c in sorted(children))
    for m in re.finditer(r"(?<![\w:])(%s)(?=[\w{])" % heads, text):
        i = m.end()
        head = m.group(1)[:-2]
        if head == "crate":
            base = []
        elif head == "self":
            base = list(module)
        elif head.startswith("super"):
            up = head.count("super")
            if up > len(module):
                continue
            base = list(module[: len(module) - up])
        else:
            base = list(module) + [head]
        if text[i : i + 1] == "{":
            depth, j = 0, i
            while j < len(text):
                depth += text[j] == "{"
                depth -= text[j] == "}"
                j += 1
                if depth == 0:
                    break
            expand(base, text[i:j])
        else:
            n = re.match(r"[\w:]*\w", text[i:])
            if n:
                expand(base, n.group(0))
    return out


def modules(src):
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                rel = os.path.relpath(p, src)[:-3].split(os.sep)
                if rel[-1] in ("mod", "lib", "main"):
                    rel = rel[:-1]
                files[tuple(rel)] = p
    return files


def circles(graph):
    idx, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        idx[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in idx:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in idx:
            visit(v)
    return comps


def main():
    errors = []
    report = []
    crates = sorted(d for d in os.listdir(os.path.join(ROOT, "crates")))
    for crate in crates:
        src = os.path.join(ROOT, "crates", crate, "src")
        if not os.path.isdir(src):
            continue
        files = modules(src)
        graph = {k: set() for k in files}
        uses = {}
        for mod, path in files.items():
            text = code(path)
            children = {k[len(mod)] for k in files if len(k) == len(mod) + 1 and k[: len(mod)] == mod}
            # Circles: re-exports left out (a facade). Floors: every import, re-exports too.
            for p, arrow in [(p, True) for p in paths(reexports_dropped(text), mod, children)] + [
                (p, False) for p in paths(text, mod, children)
            ]:
                for n in range(len(p), 0, -1):
                    target = tuple(p[:n])
                    if target in files:
                        if target != mod and target != ():
                            if arrow:
                                graph[mod].add(target)
                            uses.setdefault((mod, target), "crate::" + "::".join(p))
                        break
        comps = circles(graph)
        for c in comps:
            names = ["/".join(m) or "lib" for m in c]
            errors.append(f"{crate}: import circle of {len(c)} files: {', '.join(names)}")
        report.append(f"{crate} {len(files)} files, {len(comps)} strict circles")
        if crate == "keel-proxy":
            floor = {r: i for i, rooms in enumerate(PROXY_FLOORS) for r in rooms}
            rooms = {m[0] for m in files if m}
            for r in sorted(rooms - set(floor)):
                errors.append(f"keel-proxy: room `{r}` is on no floor (add it to PROXY_FLOORS)")
            room_graph = {r: set() for r in rooms}
            upward = 0
            for (a, b), example in sorted(uses.items()):
                if not a or not b or a[0] == b[0]:
                    continue
                ra, rb = a[0], b[0]
                room_graph[ra].add(rb)
                if ra in floor and rb in floor and floor[rb] > floor[ra]:
                    upward += 1
                    errors.append(
                        f"keel-proxy: `{'/'.join(a)}` imports `{example}`, a floor above its own ({ra} -> {rb})"
                    )
            for c in circles(room_graph):
                errors.append(f"keel-proxy: folders in a circle: {', '.join(c)}")
            report.append(f"keel-proxy floors: {len(rooms)} rooms, {upward} upward imports")
    for e in errors:
        print("check-imports:", e, file=sys.stderr)
    print("check-imports:", "; ".join(report))
    sys.stdout.flush()
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
