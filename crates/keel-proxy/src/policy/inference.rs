//! The inference body reader: the prompt of an OpenAI request, named in blocks
//! (`keel_balance::prefix`) for a `prefix-affinity` cluster's pick.
//!
//! The first `prompt_read_limit` bytes of the body are read before the pick ([`PromptBody`])
//! and scanned ([`scan`]); the body is then sent unchanged: those bytes first, the rest
//! streamed from the client as any body is. A body that is not JSON, or whose prompt goes on
//! past the limit, is routed on what was read (nothing at all: by load); none is refused for
//! it. Memory per request: the bytes read (the limit, plus at most one read of the client's)
//! and the hasher's one partial block and block names.
//!
//! The scanner is a small tolerant one rather than serde_json on the buffered bytes: past the
//! limit the bytes end in the middle of the prompt, which is the normal case for a long one,
//! and the prompt's leading blocks are all that routing needs; it also feeds the hasher
//! string runs in place, without building the prompt's text.

use keel_balance::prefix::{PrefixHasher, BYTES_PER_TOKEN};

use crate::exchange::request::{BodyFraming, Reject, RequestBody};

/// Feeds the prompt of the OpenAI request whose body starts with `body` (all of it, or its
/// first bytes) to `h`: `prompt` (a string; of an array, its first string; an array of token
/// ids, each id's 4 bytes), or `messages` in order, each as `role: content\n` (content a
/// string, or an array of parts whose `text` strings are joined as they are), as
/// `keel backend --llm` renders them. Stops at the first byte that is not the JSON
/// it expects, or at the end of the bytes, keeping what it fed.
pub(crate) fn scan(body: &[u8], h: &mut PrefixHasher) {
    let mut c = Cur { b: body, i: 0 };
    let _ = c.top(h);
}

/// What a request body's first bytes say of its `model` (a `models` route's choice).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ModelField<'a> {
    /// The top-level `model` string: its bytes, JSON escapes decoded (borrowed when it has
    /// none).
    Named(std::borrow::Cow<'a, [u8]>),
    /// None: not a JSON object, no top-level `model`, or one that is not a string.
    Missing,
    /// The bytes end before that is known (more of the body may tell).
    Undecided,
}

/// The top-level `model` of the JSON object `body` starts with; `whole`: `body` is all of
/// it (else bytes cut short leave it [`ModelField::Undecided`]). Members before `model` are
/// skipped as they are (OpenAI's clients often send `messages` first).
pub(crate) fn model(body: &[u8], whole: bool) -> ModelField<'_> {
    let mut c = Cur { b: body, i: 0 };
    let found = (|| {
        c.eat(b'{')?;
        if c.peek()? == b'}' {
            return Some(None);
        }
        loop {
            let key = c.string()?;
            if !key.whole {
                return None;
            }
            c.eat(b':')?;
            if key.raw == b"model" {
                return match c.peek()? {
                    b'"' => {
                        let s = c.string()?;
                        s.whole.then(|| {
                            if !s.raw.contains(&b'\\') {
                                return Some(std::borrow::Cow::Borrowed(s.raw));
                            }
                            let mut name = Vec::with_capacity(s.raw.len());
                            decode_json(s.raw, &mut |b| name.extend_from_slice(b));
                            Some(std::borrow::Cow::Owned(name))
                        })
                    }
                    _ => Some(None),
                };
            }
            c.skip()?;
            if !c.next_member(b'}')? {
                return Some(None);
            }
        }
    })();
    match found {
        Some(Some(name)) => ModelField::Named(name),
        Some(None) => ModelField::Missing,
        // Not an object at all: nothing more can make it one.
        None if body.trim_ascii_start().first().is_some_and(|b| *b != b'{') => ModelField::Missing,
        None if whole => ModelField::Missing,
        None => ModelField::Undecided,
    }
}

/// The top-level `max_tokens` or `max_completion_tokens` (the first of them that is a whole
/// number) of the JSON object `body` starts with: the completion tokens a request may take, for
/// a token budget's estimate. `None` when neither is within the bytes.
pub(crate) fn max_tokens(body: &[u8]) -> Option<u64> {
    let mut c = Cur { b: body, i: 0 };
    c.eat(b'{')?;
    if c.peek()? == b'}' {
        return None;
    }
    loop {
        let key = c.string()?;
        c.eat(b':')?;
        if key.whole && matches!(key.raw, b"max_tokens" | b"max_completion_tokens") {
            c.ws();
            let start = c.i;
            c.skip()?;
            if let Ok(n) = std::str::from_utf8(&c.b[start..c.i]).unwrap_or("").parse() {
                return Some(n);
            }
        } else {
            c.skip()?;
        }
        if !c.next_member(b'}')? {
            return None;
        }
    }
}

/// A position in the bytes; every method returns `None` at their end or at bytes that are not
/// what it expects (the scan then stops).
struct Cur<'a> {
    b: &'a [u8],
    i: usize,
}

/// A JSON string's raw bytes (escapes not decoded) and whether its closing quote was seen.
#[derive(Clone, Copy)]
struct Str<'a> {
    raw: &'a [u8],
    whole: bool,
}

impl<'a> Cur<'a> {
    fn ws(&mut self) {
        while self
            .b
            .get(self.i)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.peek()? == want).then(|| self.i += 1)
    }

    /// A string at the cursor (after its opening quote is checked), possibly cut short.
    fn string(&mut self) -> Option<Str<'a>> {
        self.eat(b'"')?;
        let start = self.i;
        let mut k = start;
        while k < self.b.len() {
            match self.b[k] {
                b'"' => {
                    self.i = k + 1;
                    return Some(Str {
                        raw: &self.b[start..k],
                        whole: true,
                    });
                }
                b'\\' => k += 2,
                _ => k += 1,
            }
        }
        self.i = self.b.len();
        Some(Str {
            raw: &self.b[start..],
            whole: false,
        })
    }

    /// Skips one value of any kind; `None` if it is cut short or malformed.
    fn skip(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string()?.whole.then_some(()),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            if !self.string()?.whole {
                                return None;
                            }
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                // A number, true, false, null: up to the next delimiter.
                let rest = &self.b[self.i..];
                let n = rest
                    .iter()
                    .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t'))?;
                (n > 0).then(|| self.i += n)
            }
        }
    }

    /// After a member's value: `,` (another follows: true) or the end `close` (false).
    fn next_member(&mut self, close: u8) -> Option<bool> {
        match self.peek()? {
            b',' => {
                self.i += 1;
                Some(true)
            }
            b if b == close => {
                self.i += 1;
                Some(false)
            }
            _ => None,
        }
    }

    /// The request object: finds `prompt` or `messages` among its members.
    fn top(&mut self, h: &mut PrefixHasher) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.eat(b':')?;
            match key.raw {
                b"prompt" => return self.prompt(h),
                b"messages" => return self.messages(h),
                _ => self.skip()?,
            }
            if !self.next_member(b'}')? {
                return Some(());
            }
        }
    }

    /// `prompt`: a string, or the first string of an array (a batch: its first prompt
    /// stands for it), or token ids (each one's 4 bytes, as `prefix::token_id` reads them).
    fn prompt(&mut self, h: &mut PrefixHasher) -> Option<()> {
        match self.peek()? {
            b'"' => push_json(h, self.string()?.raw),
            b'[' => {
                self.i += 1;
                if self.peek()? == b'"' {
                    push_json(h, self.string()?.raw);
                    return Some(());
                }
                loop {
                    let start = self.i;
                    self.skip()?;
                    let id: u32 = std::str::from_utf8(&self.b[start..self.i])
                        .ok()?
                        .trim()
                        .parse()
                        .ok()?;
                    h.push(&id.to_le_bytes());
                    if !self.next_member(b']')? {
                        return Some(());
                    }
                }
            }
            _ => {}
        }
        Some(())
    }

    /// `messages`: each one's role and content, in order.
    fn messages(&mut self, h: &mut PrefixHasher) -> Option<()> {
        self.eat(b'[')?;
        if self.peek()? == b']' {
            return Some(());
        }
        loop {
            self.message(h)?;
            if !self.next_member(b']')? {
                return Some(());
            }
        }
    }

    /// One message, fed as `role: content\n` once both are found, whatever their order (or
    /// as far as it goes when the bytes end within it, its role known).
    fn message(&mut self, h: &mut PrefixHasher) -> Option<()> {
        let mut role: Option<Str<'a>> = None;
        // The content: a string, or the bytes of an array of parts.
        let mut content: Option<Content<'a>> = None;
        let out = (|| {
            self.eat(b'{')?;
            if self.peek()? == b'}' {
                self.i += 1;
                return Some(());
            }
            loop {
                let key = self.string()?;
                self.eat(b':')?;
                match (key.raw, self.peek()?) {
                    (b"role", b'"') => role = Some(self.string()?),
                    (b"content", b'"') => content = Some(Content::Text(self.string()?)),
                    (b"content", b'[') => {
                        let start = self.i;
                        let done = self.skip();
                        let end = if done.is_some() { self.i } else { self.b.len() };
                        content = Some(Content::Parts(&self.b[start..end]));
                        done?;
                    }
                    _ => self.skip()?,
                }
                if !self.next_member(b'}')? {
                    return Some(());
                }
            }
        })();
        // Fed even when the message was cut short: its first bytes are the prompt's.
        if let Some(role) = role {
            push_json(h, role.raw);
            h.push(b": ");
            match content {
                Some(Content::Text(s)) => push_json(h, s.raw),
                Some(Content::Parts(bytes)) => parts(bytes, h),
                None => {}
            }
            if out.is_some() {
                h.push(b"\n");
            }
        }
        out
    }
}

enum Content<'a> {
    Text(Str<'a>),
    Parts(&'a [u8]),
}

/// A content array's parts' `text` strings (`{"type": "text", "text": ...}`), joined as they
/// are.
fn parts(bytes: &[u8], h: &mut PrefixHasher) {
    let mut c = Cur { b: bytes, i: 0 };
    let _ = (|| {
        c.eat(b'[')?;
        if c.peek()? == b']' {
            return Some(());
        }
        loop {
            let mut text: Option<Str<'_>> = None;
            let whole = (|| {
                c.eat(b'{')?;
                if c.peek()? == b'}' {
                    c.i += 1;
                    return Some(());
                }
                loop {
                    let key = c.string()?;
                    c.eat(b':')?;
                    match (key.raw, c.peek()?) {
                        (b"text", b'"') => text = Some(c.string()?),
                        _ => c.skip()?,
                    }
                    if !c.next_member(b'}')? {
                        return Some(());
                    }
                }
            })();
            if let Some(t) = text {
                push_json(h, t.raw);
            }
            whole?;
            if !c.next_member(b']')? {
                return Some(());
            }
        }
    })();
}

/// Feeds a JSON string's raw bytes, escapes decoded, to `h` (runs without escapes in place);
/// stops at an escape cut short.
fn push_json(h: &mut PrefixHasher, raw: &[u8]) {
    decode_json(raw, &mut |b| h.push(b));
}

/// Hands a JSON string's raw bytes, escapes decoded, to `push` (runs without escapes in
/// place); stops at an escape cut short.
fn decode_json(mut raw: &[u8], push: &mut impl FnMut(&[u8])) {
    let h = push;
    while let Some(at) = raw.iter().position(|&b| b == b'\\') {
        h(&raw[..at]);
        let Some(&e) = raw.get(at + 1) else { return };
        raw = &raw[at + 2..];
        let byte = match e {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let Some(mut cp) = hex4(raw) else { return };
                raw = &raw[4..];
                if (0xd800..0xdc00).contains(&cp) {
                    // A surrogate pair: the low half follows as another `\u`.
                    match raw.strip_prefix(b"\\u").and_then(hex4) {
                        Some(lo) if (0xdc00..0xe000).contains(&lo) => {
                            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                            raw = &raw[6..];
                        }
                        _ => cp = 0xfffd,
                    }
                }
                let ch = char::from_u32(cp).unwrap_or('\u{fffd}');
                let mut utf8 = [0u8; 4];
                h(ch.encode_utf8(&mut utf8).as_bytes());
                continue;
            }
            _ => return,
        };
        h(&[byte]);
    }
    h(raw);
}

fn hex4(b: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(b.get(..4)?).ok()?;
    u32::from_str_radix(s, 16).ok()
}

/// The most blocks a prompt read within `limit` bytes can name.
pub(crate) fn max_blocks(limit: usize, block_tokens: usize) -> usize {
    limit / (block_tokens.max(1) * BYTES_PER_TOKEN) + 1
}

/// A streamed request body whose first bytes were read before the pick: they go out first
/// (again on a retry, while nothing past them was sent), then the rest from the client.
pub(crate) struct PromptBody<'b, B> {
    inner: &'b mut B,
    /// The bytes read before the pick.
    head: Vec<u8>,
    /// The client's body ended within them.
    ended: bool,
    /// The client failed while they were read: reported where the body reaches that point.
    failed: Option<Reject>,
    /// The body is sent with its length (not chunked): read whole, it may go in one write
    /// with the head.
    sized: bool,
    /// `head` was handed out in this try.
    head_sent: bool,
    /// A piece past `head` was handed out: the body cannot be sent again.
    past_head: bool,
}

impl<'b, B: RequestBody> PromptBody<'b, B> {
    /// Reads `inner` until it ends or `limit` bytes are in (the last read may go past it).
    pub(crate) async fn read(inner: &'b mut B, sized: bool, limit: usize) -> Self {
        let mut read = Self::new(inner, sized);
        read.fill(limit, |_, _| false).await;
        read
    }

    /// Nothing read yet; `sized`: the body goes with its length (see [`Self::inline`]).
    pub(crate) fn new(inner: &'b mut B, sized: bool) -> Self {
        Self {
            inner,
            head: Vec::new(),
            ended: false,
            failed: None,
            sized,
            head_sent: false,
            past_head: false,
        }
    }

    /// A body read whole, forwarded as `bytes` (`inner`'s other answers, its trailers, stay).
    fn whole(inner: &'b mut B, bytes: Vec<u8>) -> Self {
        Self {
            inner,
            head: bytes,
            ended: true,
            failed: None,
            sized: true,
            head_sent: false,
            past_head: false,
        }
    }

    /// Reads on until the body ends, fails, `limit` bytes are in, or `enough` (given the
    /// bytes so far and whether they are all) says so; `enough` is asked each time the bytes
    /// have doubled, so that a body is scanned in time linear in its length (the caller
    /// judges the bytes it ends with).
    pub(crate) async fn fill(&mut self, limit: usize, mut enough: impl FnMut(&[u8], bool) -> bool) {
        let mut check_at = 0;
        while self.head.len() < limit && !self.ended && self.failed.is_none() {
            if self.head.len() >= check_at && !self.head.is_empty() {
                if enough(&self.head, false) {
                    return;
                }
                check_at = self.head.len() * 2;
            }
            match self.inner.next_piece().await {
                Ok([]) => self.ended = true,
                Ok(piece) => self.head.extend_from_slice(piece),
                Err(r) => self.failed = Some(r),
            }
        }
    }

    /// The body ended within the bytes read.
    pub(crate) fn ended(&self) -> bool {
        self.ended && self.failed.is_none()
    }

    /// The bytes read before the pick.
    pub(crate) fn head(&self) -> &[u8] {
        &self.head
    }
}

impl<B: RequestBody> RequestBody for PromptBody<'_, B> {
    fn inline(&self) -> Option<&[u8]> {
        // Read whole: sent in one write, and again by any try (a hedge too). Only with its
        // length: a chunked body's pieces are framed as they go.
        (self.sized && self.ended && self.failed.is_none()).then_some(&self.head[..])
    }

    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        if !self.head_sent {
            self.head_sent = true;
            if !self.head.is_empty() {
                return Ok(&self.head);
            }
        }
        if let Some(r) = self.failed {
            return Err(r);
        }
        if self.ended {
            return Ok(&[]);
        }
        self.past_head = true;
        self.inner.next_piece().await
    }

    fn started(&self) -> bool {
        self.past_head
    }

    fn waiting_on_client(&self) -> bool {
        self.inner.waiting_on_client()
    }

    fn rewind(&mut self) -> bool {
        if self.past_head {
            return false;
        }
        self.head_sent = false;
        true
    }

    fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        self.inner.trailers()
    }

    fn full_duplex(&self) -> bool {
        self.inner.full_duplex()
    }
}

/// A request body as forwarded: untouched, or with its first bytes read for the prompt
/// (boxed: only a `prefix-affinity` cluster's requests carry that state).
pub(crate) enum ForwardBody<'b, B> {
    Untouched(&'b mut B),
    Read(Box<PromptBody<'b, B>>),
}

impl<B: RequestBody> ForwardBody<'_, B> {
    /// The body's bytes read before the pick: all of it when it is held whole.
    pub(crate) fn read_bytes(&self) -> &[u8] {
        match self {
            Self::Untouched(b) => b.inline().unwrap_or_default(),
            Self::Read(b) => b.head(),
        }
    }
}

impl<B: RequestBody> RequestBody for ForwardBody<'_, B> {
    fn inline(&self) -> Option<&[u8]> {
        match self {
            Self::Untouched(b) => b.inline(),
            Self::Read(b) => b.inline(),
        }
    }
    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        match self {
            Self::Untouched(b) => b.next_piece().await,
            Self::Read(b) => b.next_piece().await,
        }
    }
    fn started(&self) -> bool {
        match self {
            Self::Untouched(b) => b.started(),
            Self::Read(b) => b.started(),
        }
    }
    fn waiting_on_client(&self) -> bool {
        match self {
            Self::Untouched(b) => b.waiting_on_client(),
            Self::Read(b) => b.waiting_on_client(),
        }
    }
    fn rewind(&mut self) -> bool {
        match self {
            Self::Untouched(b) => b.rewind(),
            Self::Read(b) => b.rewind(),
        }
    }
    fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        match self {
            Self::Untouched(b) => b.trailers(),
            Self::Read(b) => b.trailers(),
        }
    }
    fn full_duplex(&self) -> bool {
        match self {
            Self::Untouched(b) => b.full_duplex(),
            Self::Read(b) => b.full_duplex(),
        }
    }
}

/// What was read of a request before its pick.
pub(crate) struct ReadRequest<'b, B> {
    /// A `prefix-affinity` or `inference = true` cluster's: the prompt's block names.
    pub prompt: Option<Box<PrefixHasher>>,
    /// The body to forward.
    pub body: ForwardBody<'b, B>,
    /// An `inference = true` cluster's: keel added `stream_options.include_usage` to the
    /// streamed request's body, now this long (the usage event is keel's, not the client's).
    pub usage_added: Option<u64>,
}

/// The reading of a request to a `prefix-affinity` or `inference = true` cluster: its first
/// `prompt_read_limit` bytes, read before the pick. A `prefix-affinity` cluster names the
/// prompt's blocks; an `inference` one asks a streamed request's engine for `usage` when the
/// client did not (only when the body was read whole within the limit and goes with its
/// length: a longer or chunked body goes unchanged, and its answer is measured without token
/// counts). Others get their body untouched. A body some of which was read already (a
/// `models` route's) is read on from there, never twice.
pub(crate) async fn read_prompt<'b, B: RequestBody>(
    cluster: &crate::config::ClusterConfig,
    framing: BodyFraming,
    body: ForwardBody<'b, B>,
) -> ReadRequest<'b, B> {
    let balance = &cluster.balance;
    let affinity = balance.strategy == keel_balance::StrategyKind::PrefixAffinity;
    if !(affinity || cluster.inference) || framing == BodyFraming::None {
        return ReadRequest {
            prompt: None,
            body,
            usage_added: None,
        };
    }
    let limit = usize::try_from(balance.prompt_read_limit).unwrap_or(usize::MAX);
    let block_tokens = balance.block_tokens as usize;
    // An `inference` cluster names the prompt too, whatever its strategy: the access log's
    // `prefix` and `prompt_blocks` (what `keel advise` groups requests by).
    let mut prompt = (affinity || cluster.inference).then(|| {
        Box::new(PrefixHasher::new(block_tokens).with_max_blocks(max_blocks(limit, block_tokens)))
    });
    let mut read = match body {
        ForwardBody::Untouched(body) => {
            if let Some(whole) = body.inline() {
                if let Some(h) = &mut prompt {
                    scan(&whole[..whole.len().min(limit)], h);
                }
                let added = (cluster.inference && whole.len() <= limit)
                    .then(|| with_usage(whole))
                    .flatten();
                let Some(added) = added else {
                    return ReadRequest {
                        prompt,
                        body: ForwardBody::Untouched(body),
                        usage_added: None,
                    };
                };
                let len = added.len() as u64;
                return ReadRequest {
                    prompt,
                    body: ForwardBody::Read(Box::new(PromptBody::whole(body, added))),
                    usage_added: Some(len),
                };
            }
            let sized = matches!(framing, BodyFraming::Length(_));
            Box::new(PromptBody::read(body, sized, limit).await)
        }
        ForwardBody::Read(mut read) => {
            read.fill(limit, |_, _| false).await;
            read
        }
    };
    if let Some(h) = &mut prompt {
        let head = read.head();
        scan(&head[..head.len().min(limit)], h);
    }
    let mut usage_added = None;
    if cluster.inference && read.inline().is_some_and(|b| b.len() <= limit) {
        if let Some(added) = with_usage(&read.head) {
            usage_added = Some(added.len() as u64);
            read.head = added;
        }
    }
    ReadRequest {
        prompt,
        body: ForwardBody::Read(read),
        usage_added,
    }
}

/// What a request body says of its stream and its usage (top-level members only).
#[derive(Debug, Default, PartialEq, Eq)]
struct StreamAsk {
    /// `"stream": true`.
    stream: bool,
    /// Where `stream_options`' object starts (after its `{`), and whether it is empty.
    options: Option<(usize, bool)>,
    /// `stream_options.include_usage`'s value and where it starts.
    include_usage: Option<(bool, usize)>,
    /// The object was read to its closing brace.
    complete: bool,
}

impl Cur<'_> {
    /// The request object's `stream` and `stream_options`.
    fn stream_ask(&mut self, ask: &mut StreamAsk) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            ask.complete = true;
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.eat(b':')?;
            match (key.raw, self.peek()?) {
                (b"stream", b't') => {
                    ask.stream = self.b[self.i..].starts_with(b"true");
                    self.skip()?;
                }
                (b"stream_options", b'{') => self.options(ask)?,
                _ => self.skip()?,
            }
            if !self.next_member(b'}')? {
                ask.complete = true;
                return Some(());
            }
        }
    }

    /// `stream_options`: where its members go, and `include_usage`.
    fn options(&mut self, ask: &mut StreamAsk) -> Option<()> {
        self.eat(b'{')?;
        let inside = self.i;
        if self.peek()? == b'}' {
            self.i += 1;
            ask.options = Some((inside, true));
            return Some(());
        }
        ask.options = Some((inside, false));
        loop {
            let key = self.string()?;
            self.eat(b':')?;
            let at = {
                self.ws();
                self.i
            };
            if key.raw == b"include_usage" {
                let rest = &self.b[at..];
                if rest.starts_with(b"true") {
                    ask.include_usage = Some((true, at));
                } else if rest.starts_with(b"false") {
                    ask.include_usage = Some((false, at));
                }
            }
            self.skip()?;
            if !self.next_member(b'}')? {
                return Some(());
            }
        }
    }
}

/// A streamed request's body with `stream_options.include_usage` set to true, when the body
/// (whole, valid to its closing brace as far as the scan reads it) streams and does not ask
/// for usage already; `None` otherwise.
fn with_usage(body: &[u8]) -> Option<Vec<u8>> {
    let mut ask = StreamAsk::default();
    let _ = Cur { b: body, i: 0 }.stream_ask(&mut ask);
    if !ask.complete || !ask.stream {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + 40);
    match (ask.include_usage, ask.options) {
        (Some((true, _)), _) => return None,
        // Same length: `false` becomes `true ` (a blank is valid JSON).
        (Some((false, at)), _) => {
            out.extend_from_slice(body);
            out[at..at + 5].copy_from_slice(b"true ");
        }
        (None, Some((inside, empty))) => {
            out.extend_from_slice(&body[..inside]);
            out.extend_from_slice(if empty {
                &b"\"include_usage\":true"[..]
            } else {
                b"\"include_usage\":true,"
            });
            out.extend_from_slice(&body[inside..]);
        }
        (None, None) => {
            // After the object's `{` (the scan read one; the object has members).
            let brace = body.iter().position(|b| *b == b'{')? + 1;
            out.extend_from_slice(&body[..brace]);
            out.extend_from_slice(b"\"stream_options\":{\"include_usage\":true},");
            out.extend_from_slice(&body[brace..]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks_of(body: &[u8]) -> Vec<u64> {
        let mut h = PrefixHasher::new(1);
        scan(body, &mut h);
        h.blocks().to_vec()
    }

    fn text_blocks(text: &str) -> Vec<u64> {
        let mut h = PrefixHasher::new(1);
        h.push(text.as_bytes());
        h.blocks().to_vec()
    }

    #[test]
    fn a_prompt_string_or_array() {
        let want = text_blocks("Once upon a time, \"quoted\"\n\u{e9}\u{1f600}");
        let body = br#"{"model":"m","max_tokens":5,"prompt":"Once upon a time, \"quoted\"\n\u00e9\ud83d\ude00","stream":true}"#;
        assert_eq!(blocks_of(body), want);
        let body = br#"{"prompt": ["Once upon a time, \"quoted\"\n\u00e9\ud83d\ude00", "other"]}"#;
        assert_eq!(blocks_of(body), want);
        // Token ids: each one's 4 bytes.
        let ids: Vec<u8> = [1u32, 2, 70000, 4]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect();
        let mut h = PrefixHasher::new(1);
        h.push(&ids);
        assert_eq!(blocks_of(br#"{"prompt":[1, 2,70000 ,4]}"#), h.blocks());
    }

    #[test]
    fn messages_render_as_the_engine_renders_them() {
        let mut h = PrefixHasher::new(1);
        h.push_message("system", "Be terse.");
        h.push_message("user", "Hi there\nfriend");
        h.push_message("user", "ab");
        let want = h.blocks().to_vec();
        let body = br#"{"messages":[{"role":"system","content":"Be terse."},
            {"content":"Hi there\nfriend","role":"user","name":"x"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}},{"text":"b","type":"text"}]}],
            "model":"m","nested":{"prompt":"not this"}}"#;
        assert_eq!(blocks_of(body), want);
        // Keys before `messages` that hold look-alikes are skipped whole.
        let body2 = br#"{"model":{"messages":[{"role":"x","content":"y"}]},"x":[1,"]}",{"a":"\"}"}],"messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"Hi there\nfriend"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
        assert_eq!(blocks_of(body2), want);
    }

    #[test]
    fn a_cut_body_gives_the_blocks_read_so_far() {
        let prompt = "x".repeat(400);
        let body = format!(r#"{{"messages":[{{"role":"user","content":"{prompt}"}}]}}"#);
        let whole = blocks_of(body.as_bytes());
        for cut in [10, 30, 100, 250, body.len() - 3] {
            let part = blocks_of(&body.as_bytes()[..cut]);
            assert!(part.len() <= whole.len());
            assert_eq!(part[..], whole[..part.len()], "cut at {cut}");
        }
        assert!(blocks_of(&body.as_bytes()[..250]).len() >= 50);
    }

    #[test]
    fn anything_else_names_nothing() {
        for body in [
            &b""[..],
            b"not json at all",
            b"\x00\xff\xfe",
            b"[1,2,3]",
            br#"{"model":"m"}"#,
            br#"{"prompt":42}"#,
            br#"{"messages":"no"}"#,
            br#"{"a":tru"#,
        ] {
            assert!(blocks_of(body).is_empty(), "{body:?}");
        }
    }

    fn usage_of(body: &str) -> Option<String> {
        with_usage(body.as_bytes()).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn a_stream_that_does_not_ask_for_usage_is_made_to() {
        let want = |s: &str| {
            let v: serde_json::Value = serde_json::from_str(s).unwrap();
            assert_eq!(v["stream_options"]["include_usage"], true, "{s}");
            v
        };
        let v = want(&usage_of(r#"{"model":"m","prompt":"hi","stream":true}"#).unwrap());
        assert_eq!(v["prompt"], "hi");
        let v = want(
            &usage_of(
                r#" { "stream" : true, "stream_options": {"continuous_usage_stats": false}}"#,
            )
            .unwrap(),
        );
        assert_eq!(v["stream_options"]["continuous_usage_stats"], false);
        want(&usage_of(r#"{"stream":true,"stream_options":{ }}"#).unwrap());
        let same = r#"{"stream":true,"stream_options":{"include_usage": false}}"#;
        let got = usage_of(same).unwrap();
        assert_eq!(got.len(), same.len());
        want(&got);
        // Asked already, not streamed, or not read whole: unchanged.
        for body in [
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"{"stream":false,"prompt":"x"}"#,
            r#"{"prompt":"x"}"#,
            r#"{"stream":true,"prompt":"cut sh"#,
            r#"{"model":{"stream":true}}"#,
            "not json",
        ] {
            assert_eq!(usage_of(body), None, "{body}");
        }
    }

    #[test]
    fn the_model_is_found_among_the_top_level_members_or_said_missing() {
        let named = |b: &[u8], whole| match model(b, whole) {
            ModelField::Named(n) => Some(String::from_utf8(n.into_owned()).unwrap()),
            _ => None,
        };
        let body = br#"{"messages":[{"role":"user","content":"{\"model\":\"no\"}"}],"n":1,"model":"llama-3","stream":true}"#;
        assert_eq!(named(body, true).as_deref(), Some("llama-3"));
        assert_eq!(
            named(br#" { "model" : "q\u0077en" }"#, true).as_deref(),
            Some("qwen")
        );
        assert_eq!(named(br#"{"model":"a\"b"}"#, true).as_deref(), Some("a\"b"));
        // Cut anywhere before the name's closing quote: more may tell.
        for cut in 1..body.len() {
            let at = model(&body[..cut], false);
            let closed = cut > body.windows(8).position(|w| w == br#"llama-3""#).unwrap() + 7;
            match at {
                ModelField::Named(n) => assert!(closed && &n[..] == b"llama-3", "cut {cut}"),
                ModelField::Undecided => assert!(!closed, "cut {cut}"),
                ModelField::Missing => panic!("cut {cut}: missing"),
            }
        }
        for (b, whole) in [
            (&br#"{"prompt":"x"}"#[..], true),
            (br#"{"model":7,"prompt":"x"}"#, false),
            (br#"{"model":null}"#, true),
            (br#"{"nested":{"model":"x"}}"#, true),
            (b"model=qwen", false),
            (b"[1,2]", false),
            (br#"{"prompt":"x""#, true),
            (b"", true),
        ] {
            assert_eq!(
                model(b, whole),
                ModelField::Missing,
                "{:?}",
                String::from_utf8_lossy(b)
            );
        }
        assert_eq!(model(br#"{"prompt":"x"#, false), ModelField::Undecided);
        assert_eq!(model(b"", false), ModelField::Undecided);
    }

    #[test]
    fn max_tokens_is_a_top_level_whole_number() {
        assert_eq!(
            max_tokens(br#"{"messages":[{"max_tokens":9}],"max_tokens": 12,"n":1}"#),
            Some(12)
        );
        assert_eq!(
            max_tokens(br#"{"model":"m","max_completion_tokens":40}"#),
            Some(40)
        );
        assert_eq!(
            max_tokens(br#"{"max_tokens":null,"max_completion_tokens":5}"#),
            Some(5)
        );
        for body in [
            &br#"{"prompt":"x"}"#[..],
            br#"{"max_tokens":-1}"#,
            br#"{"max_tokens":1.5}"#,
            br#"{"prompt":"cut sh"#,
            b"[1]",
            b"",
        ] {
            assert_eq!(max_tokens(body), None, "{}", String::from_utf8_lossy(body));
        }
    }

    #[tokio::test]
    async fn a_chunked_prompt_body_is_never_sent_inline() {
        let data = vec![7u8; 100];
        let mut whole: &[u8] = &data;
        let b = PromptBody::read(&mut whole, false, 4096).await;
        assert!(b.ended() && b.inline().is_none());
    }

    #[tokio::test]
    async fn a_prompt_body_resends_its_head_until_it_streamed_past_it() {
        let data = vec![7u8; 1000];
        let mut whole: &[u8] = &data;
        let mut b = PromptBody::read(&mut whole, true, 4096).await;
        assert_eq!(b.inline().map(<[u8]>::len), Some(1000));
        // A streamed body: the test's `&[u8]` hands out everything in one piece, so a limit
        // below it still reads it all; the rewind rule is what is checked here.
        assert_eq!(b.next_piece().await.unwrap().len(), 1000);
        assert!(b.rewind());
        assert_eq!(b.next_piece().await.unwrap().len(), 1000);
        assert_eq!(b.next_piece().await.unwrap().len(), 0);
        assert!(!b.started());
    }
}
