//! What the driver hands back to the front end: keel's own answer (as detailed as the
//! listener shows) or the endpoint's response with the [`Tail`] that finishes
//! its pick.

use crate::config::ErrorDetail;
use crate::driver::account::{DownstreamGuard, Tail};
use crate::driver::tries::Tries;
use crate::exchange::error::{Cause, Detailed};
use crate::exchange::request::{Client, Reject};
use crate::upstream::cluster::Cluster;

/// The body text of keel's own answers: `"<status> <reason>: <cause>\n"`.
pub(crate) fn answer_text(status: u16, cause: &str) -> String {
    format!("{status} {}: {cause}\n", reason(status))
}

/// The standard reason phrase of a status.
pub(crate) fn reason(status: u16) -> &'static str {
    hyper::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("")
}

/// keel's answer to a request that no route matches on a listener without `cluster`.
pub(crate) fn not_found() -> OwnAnswer {
    plain(404, "no route matches the request", 0)
}

/// keel's answer to a request refused before it reached the driver.
pub(crate) fn refused(reject: Reject) -> OwnAnswer {
    plain(reject.status(), reject.cause(), 0)
}

/// keel's 502 in place of an endpoint's response that cannot be passed on (`cause`), after
/// the one try that got it.
pub(crate) fn unforwardable(cause: &str) -> OwnAnswer {
    plain(502, cause, 1)
}

/// An answer of keel's with no endpoint to name, no headers of its own and nothing counted in
/// flight.
fn plain(status: u16, cause: &str, attempts: u32) -> OwnAnswer {
    OwnAnswer {
        status,
        text: answer_text(status, cause),
        endpoint: None,
        show_endpoint: false,
        guard: None,
        attempts,
        cause: cause.to_string(),
        tries: Tries::default(),
        headers: Vec::new(),
    }
}

/// keel's answer to a request of a `models` route whose body names a model the route does
/// not list (`model`, cut to 256 bytes in the text): `404` in OpenAI's error shape.
pub(crate) fn model_not_found(model: &[u8]) -> OwnAnswer {
    let name = String::from_utf8_lossy(&model[..model.len().min(256)]);
    let message = format!("The model `{name}` does not exist.");
    openai_error(
        404,
        &message,
        Some("model_not_found"),
        format!("no route for model {name:?}"),
    )
}

/// keel's answer to a request of a `models` route without a default `cluster` whose body
/// names no model (none, not a string, not JSON, or not within the bytes read): `400` in
/// OpenAI's error shape.
pub(crate) fn model_missing(read_limit: usize) -> OwnAnswer {
    let message = format!(
        "You must provide a model parameter (a string `model` in the JSON body's first {} KiB).",
        read_limit / 1024
    );
    openai_error(400, &message, None, "the body names no model".to_string())
}

/// keel's answer to a request its tenant's token budget cannot cover: `429` in OpenAI's
/// error shape (`"type": "tokens"`, `"code": "rate_limit_exceeded"`, as OpenAI answers a
/// tokens-per-minute limit), with `Retry-After` (whole seconds, at least 1).
pub(crate) fn token_budget_spent(message: &str, retry_after: u64, cause: String) -> OwnAnswer {
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "tokens",
        "param": null,
        "code": "rate_limit_exceeded",
    }});
    let mut own = openai_body(429, body, cause);
    own.headers.push((
        hyper::header::RETRY_AFTER,
        hyper::http::HeaderValue::from(retry_after),
    ));
    own
}

/// `{"error":{"message","type":"invalid_request_error","param":"model","code"}}`, as
/// OpenAI's API and vLLM answer a request's error, with its JSON content type.
fn openai_error(status: u16, message: &str, code: Option<&str>, cause: String) -> OwnAnswer {
    let body = serde_json::json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": "model",
        "code": code,
    }});
    openai_body(status, body, cause)
}

/// keel's answer of `status` with an OpenAI error `body`.
fn openai_body(status: u16, body: serde_json::Value, cause: String) -> OwnAnswer {
    let mut text = body.to_string();
    text.push('\n');
    OwnAnswer {
        status,
        text,
        endpoint: None,
        show_endpoint: false,
        guard: None,
        attempts: 0,
        cause,
        tries: Tries::default(),
        headers: vec![(
            hyper::header::CONTENT_TYPE,
            hyper::http::HeaderValue::from_static("application/json"),
        )],
    }
}

/// keel's answer to a request of a route with `redirect`: the status, and `location` (its
/// variables expanded) as `Location`.
pub(crate) fn redirect(status: u16, location: &[u8]) -> OwnAnswer {
    let location = hyper::http::HeaderValue::from_bytes(location)
        .unwrap_or_else(|_| hyper::http::HeaderValue::from_static("/"));
    OwnAnswer {
        status,
        text: answer_text(status, location.to_str().unwrap_or("")),
        endpoint: None,
        show_endpoint: false,
        guard: None,
        attempts: 0,
        cause: "redirected by the route's `redirect`".to_string(),
        tries: Tries::default(),
        headers: vec![(hyper::header::LOCATION, location)],
    }
}

/// keel's own answer to a request.
pub(crate) struct OwnAnswer {
    /// The status.
    pub status: u16,
    /// The body (see [`answer_text`]), with as much detail as the listener shows.
    pub text: String,
    /// The endpoint the last try went to, if any (logged).
    pub endpoint: Option<hyper::http::HeaderValue>,
    /// The cluster shows it to the client (`x-keel-endpoint`, `response_headers.endpoint`).
    pub show_endpoint: bool,
    /// Counts the request as in flight until the answer is sent.
    pub guard: Option<DownstreamGuard>,
    /// Tries made.
    pub attempts: u32,
    /// The cause in full, as logged (the access log's `cause`).
    pub cause: String,
    /// Every try made (the access log's `tries`).
    pub tries: Tries,
    /// Headers of its own (`Retry-After` of a 429, `Location` of a redirect); empty, and
    /// never allocated, for the others.
    pub headers: Vec<(hyper::header::HeaderName, hyper::http::HeaderValue)>,
}

impl OwnAnswer {
    /// The `x-keel-endpoint` value to send, if the cluster shows it.
    pub fn shown_endpoint(&self) -> Option<&hyper::http::HeaderValue> {
        self.endpoint.as_ref().filter(|_| self.show_endpoint)
    }
}

/// The endpoint's response, head read; its body still to come unless it was small. `W` is
/// the leg's response (for HTTP: [`crate::leg::UpstreamResponse`]).
pub(crate) struct Upstream<W> {
    /// The response.
    pub response: W,
    /// Finishes the pick once the body is through.
    pub tail: Tail,
}

/// What the driver decided: the front end sends it.
pub(crate) enum Answer<W> {
    /// keel answers itself.
    Own(OwnAnswer),
    /// The endpoint's response goes to the client.
    Upstream(Upstream<W>),
}

/// keel's own answer, its text as detailed as the listener shows (the front end's
/// [`crate::observe::record::Record`] counts it and logs a 5xx).
pub(crate) fn own(
    cluster: &Cluster,
    client: &Client,
    status: u16,
    cause: &Cause,
    endpoint: Option<usize>,
    guard: Option<DownstreamGuard>,
    attempts: u32,
) -> OwnAnswer {
    let entry = endpoint.map(|i| &cluster.endpoints[i]);
    let address = entry.map(|e| e.authority.as_str());
    let full = Detailed {
        cause,
        cluster: cluster.name(),
        endpoint: address,
    }
    .to_string();
    let text = match client.error_detail {
        ErrorDetail::Full => answer_text(status, &full),
        ErrorDetail::Brief => answer_text(status, cause.brief()),
    };
    OwnAnswer {
        status,
        text,
        endpoint: entry.map(|e| e.header.clone()),
        show_endpoint: cluster
            .config
            .policy
            .response_headers
            .as_ref()
            .is_some_and(|r| r.endpoint),
        guard,
        attempts,
        cause: full,
        tries: Tries::default(),
        headers: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_answers_name_status_reason_and_cause() {
        assert_eq!(answer_text(502, "x"), "502 Bad Gateway: x\n");
        assert_eq!(not_found().status, 404);
    }
}
