//! The OpenAI-compatible shapes `keel backend --llm` reads and writes, as vLLM's server does:
//! completion and chat requests, their answers whole and as server-sent chunks, `usage` with
//! `prompt_tokens_details.cached_tokens`, `/tokenize`, the render endpoints, `/v1/models`, and
//! errors as `{"error": {"message", "type", "param", "code"}}`.
//!
//! Prompts become tokens and block names by `keel_balance::prefix` (chat: `role: content\n` per
//! message), the same rule as keel's `prefix-affinity` strategy and proxy.

use std::sync::Arc;

use bytes::Bytes;
use keel_balance::mix64;
use keel_balance::prefix::{self, PrefixHasher};
use serde_json::{json, Value};

/// vLLM's `max_tokens` when a completion request gives none.
pub(crate) const DEFAULT_MAX_TOKENS: usize = 16;

/// The two generation APIs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/completions`: a `prompt`.
    Completions,
    /// `/v1/chat/completions`: `messages`.
    Chat,
}

impl Api {
    fn id_prefix(self) -> &'static str {
        match self {
            Api::Completions => "cmpl-",
            Api::Chat => "chatcmpl-",
        }
    }
}

/// A client error, as vLLM answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub(crate) status: u16,
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            param,
        }
    }

    /// vLLM's answer to a model it does not serve.
    pub(crate) fn no_model(model: &str) -> Self {
        ApiError {
            status: 404,
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`.
    pub(crate) fn body(&self) -> Bytes {
        let kind = match self.status {
            404 => "NotFoundError",
            400 => "BadRequestError",
            _ => "InternalServerError",
        };
        let v = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.status,
        }});
        Bytes::from(v.to_string())
    }
}

/// A generation, tokenize or render request, read.
#[derive(Debug)]
pub(crate) struct Parsed {
    /// The `model` asked for, if any.
    pub(crate) model: Option<String>,
    /// The prompt's full blocks, named.
    pub(crate) blocks: Vec<u64>,
    pub(crate) prompt_tokens: usize,
    /// The prompt's token ids, when asked for.
    pub(crate) token_ids: Option<Vec<u32>>,
    pub(crate) max_tokens: usize,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// The request as sent (the render endpoints echo some of it).
    pub(crate) raw: Value,
}

/// Reads a request of `api` (`tokenize`: either form, `prompt` or `messages`).
pub(crate) fn parse(
    api: Option<Api>,
    body: &[u8],
    block_tokens: usize,
    want_ids: bool,
) -> Result<Parsed, ApiError> {
    let raw: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("invalid JSON in the request body: {e}"), None))?;
    let obj = raw
        .as_object()
        .ok_or_else(|| ApiError::bad("the request body must be a JSON object", None))?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) => Some(m.clone()),
        Some(_) => return Err(ApiError::bad("`model` must be a string", Some("model"))),
    };
    let api = match api {
        Some(a) => a,
        None if obj.contains_key("messages") => Api::Chat,
        None => Api::Completions,
    };
    let mut hasher = PrefixHasher::new(block_tokens);
    // The prompt's bytes, when its token ids are wanted (cut into tokens at the end, as one
    // text: a message's last token may run into the next message).
    let mut ids = want_ids.then(Vec::new);
    match api {
        Api::Completions => prompt(obj.get("prompt"), &mut hasher, &mut ids)?,
        Api::Chat => messages(obj.get("messages"), &mut hasher, &mut ids)?,
    }
    let max_key = match (api, obj.get("max_completion_tokens")) {
        (Api::Chat, Some(v)) if !v.is_null() => "max_completion_tokens",
        _ => "max_tokens",
    };
    let max_tokens = match obj.get(max_key) {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => {
                return Err(ApiError::bad(
                    format!("`{max_key}` must be an integer of at least 1"),
                    Some("max_tokens"),
                ))
            }
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("`stream` must be a boolean", Some("stream"))),
    };
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(opts) if stream => opts
            .get("include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::bad(
                "Stream options can only be defined when `stream=True`.",
                Some("stream_options"),
            ))
        }
    };
    Ok(Parsed {
        model,
        blocks: hasher.blocks().to_vec(),
        prompt_tokens: hasher.tokens(),
        token_ids: ids.map(|b| {
            b.chunks(prefix::BYTES_PER_TOKEN)
                .map(prefix::token_id)
                .collect()
        }),
        max_tokens,
        stream,
        include_usage,
        raw,
    })
}

fn push(hasher: &mut PrefixHasher, ids: &mut Option<Vec<u8>>, text: &[u8]) {
    hasher.push(text);
    if let Some(bytes) = ids {
        bytes.extend_from_slice(text);
    }
}

/// A completion's `prompt`: a string, or token ids, alone or as a list of one.
fn prompt(
    v: Option<&Value>,
    hasher: &mut PrefixHasher,
    ids: &mut Option<Vec<u8>>,
) -> Result<(), ApiError> {
    let bad = || {
        ApiError::bad(
            "`prompt` must be a string or a list of token ids (one prompt per request)",
            Some("prompt"),
        )
    };
    match v {
        None | Some(Value::Null) => Err(ApiError::bad("`prompt` is required", Some("prompt"))),
        Some(Value::String(s)) => {
            push(hasher, ids, s.as_bytes());
            Ok(())
        }
        Some(Value::Array(items)) if items.len() == 1 && !items[0].is_number() => {
            prompt(items.first(), hasher, ids)
        }
        Some(Value::Array(items)) => {
            // Token ids: each one is its 4 bytes, as `prefix::token_id` reads them back.
            for item in items {
                let id = item
                    .as_u64()
                    .filter(|&n| n <= u64::from(u32::MAX))
                    .ok_or_else(bad)?;
                push(hasher, ids, &(id as u32).to_le_bytes());
            }
            Ok(())
        }
        Some(_) => Err(bad()),
    }
}

/// A chat's `messages`: `role: content\n` each (`PrefixHasher::push_message`); a content may be
/// a string, null, or a list of parts whose `text` parts are joined.
fn messages(
    v: Option<&Value>,
    hasher: &mut PrefixHasher,
    ids: &mut Option<Vec<u8>>,
) -> Result<(), ApiError> {
    let Some(Value::Array(list)) = v else {
        return Err(ApiError::bad(
            "`messages` must be a list of messages",
            Some("messages"),
        ));
    };
    let mut text = String::new();
    for m in list {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad("every message needs a string `role`", Some("messages"))
        })?;
        text.clear();
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        text.push_str(t);
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "a message's `content` must be a string or a list of parts",
                    Some("messages"),
                ))
            }
        }
        match ids {
            None => hasher.push_message(role, &text),
            Some(_) => {
                // The same bytes push_message hashes, kept for the token ids.
                let rendered = format!("{role}: {text}\n");
                push(hasher, ids, rendered.as_bytes());
            }
        }
    }
    Ok(())
}

const WORDS: [&str; 32] = [
    "the", "engine", "caches", "a", "prefix", "of", "blocks", "and", "keel", "routes", "each",
    "prompt", "to", "where", "its", "tokens", "are", "warm", "so", "that", "first", "answers",
    "come", "sooner", "while", "load", "stays", "even", "across", "every", "pool", "member",
];

/// Output token `k` of request `request`: a word and a space, the same for the same seed.
pub(crate) fn word(seed: u64, request: u64, k: usize) -> &'static str {
    let h = mix64(seed ^ mix64(request) ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    WORDS[(h % WORDS.len() as u64) as usize]
}

/// The text of request `request`'s first `n` tokens.
pub(crate) fn text(seed: u64, request: u64, n: usize) -> String {
    let mut s = String::new();
    for k in 0..n {
        s.push_str(word(seed, request, k));
        s.push(' ');
    }
    s
}

/// An OpenAI `usage` object with vLLM's `prompt_tokens_details`.
pub(crate) fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// The identity of an answer: its id, creation time (Unix seconds) and model.
pub(crate) struct Head {
    pub(crate) api: Api,
    pub(crate) request: u64,
    pub(crate) created: u64,
    pub(crate) model: Arc<str>,
}

impl Head {
    fn id(&self) -> String {
        format!("{}{:016x}", self.api.id_prefix(), self.request)
    }
}

/// A whole (non-streamed) answer.
pub(crate) fn answer(head: &Head, text: &str, usage: Value) -> Bytes {
    let v = match head.api {
        Api::Completions => json!({
            "id": head.id(),
            "object": "text_completion",
            "created": head.created,
            "model": &*head.model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                         "finish_reason": "length", "stop_reason": null}],
            "usage": usage,
        }),
        Api::Chat => json!({
            "id": head.id(),
            "object": "chat.completion",
            "created": head.created,
            "model": &*head.model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": "length", "stop_reason": null}],
            "usage": usage,
        }),
    };
    Bytes::from(v.to_string())
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The server-sent event of one streamed piece: a token's text (`finish` on the last), or for
/// chat the first event's `role`.
pub(crate) fn chunk(head: &Head, piece: Piece<'_>) -> Bytes {
    let finish = match piece {
        Piece::Token { last: true, .. } => json!("length"),
        _ => Value::Null,
    };
    let v = match (head.api, piece) {
        (Api::Completions, Piece::Token { text, .. }) => json!({
            "id": head.id(), "object": "text_completion", "created": head.created,
            "model": &*head.model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                         "finish_reason": finish, "stop_reason": null}],
        }),
        (Api::Completions, Piece::Role) => return Bytes::new(),
        (Api::Chat, Piece::Role) => json!({
            "id": head.id(), "object": "chat.completion.chunk", "created": head.created,
            "model": &*head.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": null, "finish_reason": null}],
        }),
        (Api::Chat, Piece::Token { text, .. }) => json!({
            "id": head.id(), "object": "chat.completion.chunk", "created": head.created,
            "model": &*head.model,
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": null,
                         "finish_reason": finish, "stop_reason": null}],
        }),
    };
    event(&v)
}

/// A piece of a streamed answer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Piece<'a> {
    /// Chat's first event: the assistant's role.
    Role,
    /// A token's text; `last` carries `finish_reason: "length"`.
    Token { text: &'a str, last: bool },
}

/// The last chunk of a stream with `stream_options.include_usage`: no choices, the usage.
pub(crate) fn usage_chunk(head: &Head, usage: Value) -> Bytes {
    let object = match head.api {
        Api::Completions => "text_completion",
        Api::Chat => "chat.completion.chunk",
    };
    event(&json!({
        "id": head.id(), "object": object, "created": head.created, "model": &*head.model,
        "choices": [], "usage": usage,
    }))
}

/// The end of every stream.
pub(crate) const DONE: &[u8] = b"data: [DONE]\n\n";

/// `/tokenize`'s answer.
pub(crate) fn tokenize(ids: &[u32], max_model_len: usize) -> Bytes {
    Bytes::from(
        json!({"count": ids.len(), "max_model_len": max_model_len, "tokens": ids,
               "token_strs": null})
        .to_string(),
    )
}

/// A render endpoint's answer: the token-in request vLLM would generate from (a list of one for
/// completions, one object for chat).
pub(crate) fn render(head: &Head, parsed: &Parsed, ids: &[u32]) -> Bytes {
    let raw = &parsed.raw;
    let one = json!({
        "request_id": head.id(),
        "token_ids": ids,
        "features": null,
        "sampling_params": {
            "n": 1,
            "temperature": raw.get("temperature").cloned().unwrap_or(json!(1.0)),
            "top_p": raw.get("top_p").cloned().unwrap_or(json!(1.0)),
            "max_tokens": parsed.max_tokens,
        },
        "model": &*head.model,
        "stream": parsed.stream,
        "stream_options": if parsed.stream { raw.get("stream_options").cloned().unwrap_or(Value::Null) } else { Value::Null },
        "cache_salt": raw.get("cache_salt").cloned().unwrap_or(Value::Null),
        "priority": raw.get("priority").cloned().unwrap_or(json!(0)),
    });
    let v = match head.api {
        Api::Completions => Value::Array(vec![one]),
        Api::Chat => one,
    };
    Bytes::from(v.to_string())
}

/// `/v1/models`' answer.
pub(crate) fn models(model: &str, created: u64, max_model_len: usize) -> Bytes {
    Bytes::from(
        json!({"object": "list", "data": [{
            "id": model, "object": "model", "created": created, "owned_by": "vllm",
            "root": model, "parent": null, "max_model_len": max_model_len, "permission": [],
        }]})
        .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_renders_as_prefix_renders_it() {
        let body = br#"{"messages":[{"role":"system","content":"You are terse."},
            {"role":"user","content":[{"type":"text","text":"Hi"}]}]}"#;
        let with_ids = parse(Some(Api::Chat), body, 2, true).unwrap();
        let without = parse(Some(Api::Chat), body, 2, false).unwrap();
        let mut h = PrefixHasher::new(2);
        h.push_message("system", "You are terse.");
        h.push_message("user", "Hi");
        assert_eq!(with_ids.blocks, h.blocks());
        assert_eq!(without.blocks, h.blocks());
        assert_eq!(with_ids.prompt_tokens, h.tokens());
        assert_eq!(with_ids.token_ids.unwrap().len(), h.tokens());
        assert_eq!(without.max_tokens, DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn token_id_prompts_name_the_blocks_their_text_names() {
        let text = "0123456789abcdef0123456789abcdef"; // 8 tokens
        let a = parse(
            None,
            format!(r#"{{"prompt":"{text}"}}"#).as_bytes(),
            4,
            true,
        )
        .unwrap();
        let ids = a.token_ids.clone().unwrap();
        let body = format!(r#"{{"prompt":{}}}"#, serde_json::to_string(&ids).unwrap());
        let b = parse(None, body.as_bytes(), 4, false).unwrap();
        assert_eq!(a.blocks, b.blocks);
        assert_eq!((a.prompt_tokens, b.prompt_tokens), (8, 8));
    }

    #[test]
    fn bad_requests_are_400s() {
        for body in [
            &b"not json"[..],
            b"[1]",
            br#"{"prompt": 3}"#,
            br#"{"max_tokens": 4}"#,
            br#"{"prompt": "x", "max_tokens": 0}"#,
            br#"{"prompt": "x", "stream_options": {"include_usage": true}}"#,
        ] {
            let e = parse(Some(Api::Completions), body, 16, false).unwrap_err();
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
            let v: Value = serde_json::from_slice(&e.body()).unwrap();
            assert_eq!(v["error"]["code"], 400);
        }
    }

    #[test]
    fn words_are_deterministic_for_a_seed() {
        assert_eq!(text(7, 1, 20), text(7, 1, 20));
        assert_ne!(text(7, 1, 20), text(8, 1, 20));
    }
}
