//! `POST /v1/chat/completions` and `POST /v1/completions`: retrieve passages for the last
//! user message (or the prompt), put them before it as the augment recipe's `[passages]`
//! lay them out, and pass the request on to the target through the connector (`forward`),
//! its reply back with the passages in an extra top-level field, `retrieval`. A streamed
//! request gets the target's server-sent events as they arrive, after a comment event
//! holding the same field. `"retrieval": {"k": 0}` turns retrieval off for one request;
//! `"retrieval": {"k": 5, "task": "squad"}` changes it.

use crate::api::{json_body, ApiError};
use crate::routes::{k_and_task, retrieve};
use crate::{slot, Shared};
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use rak_retrieval::data::Passage;
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

#[derive(Clone, Copy)]
enum Route {
    Chat,
    Completions,
}

pub async fn chat_completions(State(state): State<Shared>, body: Body) -> Result<Response, ApiError> {
    augmented(state, body, Route::Chat).await
}

pub async fn completions(State(state): State<Shared>, body: Body) -> Result<Response, ApiError> {
    augmented(state, body, Route::Completions).await
}

async fn augmented(state: Shared, body: Body, route: Route) -> Result<Response, ApiError> {
    let mut req = json_body(body, state.opts.max_body_bytes).await?;
    let Some(connector) = state.connector.clone() else {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "this server has no target LM (start it with --target and --base-url)"));
    };
    let (k, task) = match req.remove("retrieval") {
        None | Some(Value::Null) => (state.opts.default_k, state.opts.default_task.clone()),
        Some(Value::Object(r)) => k_and_task(&state, &r, "retrieval.")?,
        Some(_) => return Err(ApiError::field("retrieval", "`retrieval` must be an object such as {\"k\": 3, \"task\": \"squad\"}")),
    };
    let stream = match req.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::field("stream", "`stream` must be true or false")),
    };
    let query = match route {
        Route::Chat => last_user_text(&req)?,
        Route::Completions => match req.get("prompt") {
            Some(Value::String(p)) => p.clone(),
            Some(_) => return Err(ApiError::field("prompt", "`prompt` must be one string (lists of prompts and token ids are not served)")),
            None => return Err(ApiError::field("prompt", "the request needs `prompt`")),
        },
    };
    let hits = if k > 0 && !query.trim().is_empty() { retrieve(&state, vec![query.clone()], k, task.clone()).await?.remove(0) } else { Vec::new() };
    if !hits.is_empty() {
        let passages: Vec<Passage> = hits.iter().map(|h| Passage { id: h.id.clone(), title: h.title.clone(), text: h.text.clone() }).collect();
        let refs: Vec<&Passage> = passages.iter().collect();
        let block = (state.format_passages)(&refs);
        place_passages(&mut req, route, &block);
    }
    let retrieval = json!({"query": query, "k": k, "task": task, "passages": hits});
    let path = match route {
        Route::Chat => "chat/completions",
        Route::Completions => "completions",
    };
    let request = json!({"op": "forward", "path": path, "body": Value::Object(req)});
    // At most --target-concurrency calls (streams included) at the target; a request whose
    // deadline passes while it waits never reaches it.
    let permit = state.target_permits.clone().acquire_owned().await.map_err(|_| ApiError::internal("the server is stopping"))?;
    if stream {
        return streamed(state, connector, request, retrieval, permit).await;
    }
    let start = Instant::now();
    let (held, _watcher) = slot::hold(permit, state.opts.request_timeout, state.metrics.clone());
    // Counted as a timeout if the request's deadline cancels this wait.
    let mut unanswered = Unanswered(Some((state.metrics.clone(), start)));
    let reply = crate::routes::blocking(move || {
        let _held = held;
        connector.complete(request)
    })
    .await;
    unanswered.0 = None;
    let reply = match reply {
        Ok(r) => r,
        Err(e) => {
            let kind = if e.status == StatusCode::GATEWAY_TIMEOUT { "timeout" } else { "error" };
            state.metrics.observe_upstream(start.elapsed().as_secs_f64(), Some(kind));
            return Err(e);
        }
    };
    finish(&state, start, reply, |status, mut body| {
        if let Value::Object(fields) = &mut body {
            fields.insert("retrieval".into(), retrieval);
        }
        (status, Json(body)).into_response()
    })
}

/// A call to the target still waited for: when the request's deadline drops the wait, the
/// call counts as timed out.
struct Unanswered(Option<(std::sync::Arc<crate::metrics::Metrics>, Instant)>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some((metrics, start)) = self.0.take() {
            metrics.observe_upstream(start.elapsed().as_secs_f64(), Some("timeout"));
        }
    }
}

/// The reply of a forwarded request as a response (through `ok`), or the error it carries.
fn finish(state: &Shared, start: Instant, reply: Value, ok: impl FnOnce(StatusCode, Value) -> Response) -> Result<Response, ApiError> {
    let secs = start.elapsed().as_secs_f64();
    if let Some(err) = reply.get("error") {
        let e = upstream_error(err);
        state.metrics.observe_upstream(secs, Some(err["kind"].as_str().unwrap_or("error")));
        return Err(e);
    }
    state.metrics.observe_upstream(secs, None);
    let status = reply["status"].as_u64().and_then(|s| StatusCode::from_u16(s as u16).ok()).unwrap_or(StatusCode::OK);
    Ok(ok(status, reply.get("body").cloned().unwrap_or(Value::Null)))
}

/// A connector error as the response: a target that timed out is 504, one that cannot be
/// reached or failed is 502, each with the connector's reason.
fn upstream_error(err: &Value) -> ApiError {
    let kind = err["kind"].as_str().unwrap_or("error");
    let message = err["message"].as_str().unwrap_or("no reason given");
    match kind {
        "timeout" => ApiError::new(StatusCode::GATEWAY_TIMEOUT, "upstream_error", format!("the target LM did not answer in time: {message}")),
        "unreachable" => ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", format!("the target LM cannot be reached: {message}")),
        // The target's rate limit, passed on with its wait so clients back off.
        "rate_limited" => ApiError {
            retry_after: Some(err["retry_after_s"].as_f64().map(|s| s.ceil().max(1.0) as u64).unwrap_or(1)),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", format!("the target LM is rate-limiting: {message}")).with_code("rate_limit_exceeded")
        },
        "rejected" | "context_length" => {
            let status = err["status"].as_u64().and_then(|s| StatusCode::from_u16(s as u16).ok()).unwrap_or(StatusCode::BAD_REQUEST);
            let e = ApiError::new(status, "invalid_request_error", format!("the target LM refused the request: {message}"));
            if kind == "context_length" {
                e.with_code("context_length_exceeded")
            } else {
                e
            }
        }
        _ => ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", format!("the target LM failed: {message}")),
    }
}

/// The text of the last user message (a string, or the text parts of a list).
fn last_user_text(req: &Map<String, Value>) -> Result<String, ApiError> {
    let Some(Value::Array(messages)) = req.get("messages") else {
        return Err(ApiError::field("messages", "the request needs `messages`, a list of {\"role\", \"content\"} objects"));
    };
    if messages.iter().any(|m| !m.is_object() || !m["role"].is_string()) {
        return Err(ApiError::field("messages", "every message must be an object with a string `role`"));
    }
    let Some(last) = messages.iter().rev().find(|m| m["role"] == "user") else {
        return Err(ApiError::field("messages", "`messages` holds no user message to retrieve for"));
    };
    match &last["content"] {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => Ok(parts.iter().filter(|p| p["type"] == "text").filter_map(|p| p["text"].as_str()).collect::<Vec<_>>().join("\n")),
        _ => Err(ApiError::field("messages", "a user message's `content` must be a string or a list of parts")),
    }
}

/// Put the passages before the last user message (or the prompt).
fn place_passages(req: &mut Map<String, Value>, route: Route, block: &str) {
    match route {
        Route::Completions => {
            if let Some(Value::String(p)) = req.get_mut("prompt") {
                *p = format!("{block}{p}");
            }
        }
        Route::Chat => {
            let Some(Value::Array(messages)) = req.get_mut("messages") else { return };
            let Some(last) = messages.iter_mut().rev().find(|m| m["role"] == "user") else { return };
            match &mut last["content"] {
                Value::String(s) => *s = format!("{block}{s}"),
                Value::Array(parts) => parts.insert(0, json!({"type": "text", "text": block})),
                _ => {}
            }
        }
    }
}

/// A streamed reply: waits for the target's first piece (or its refusal, which is answered
/// as a whole response), then sends the retrieval as a comment event and every piece as it
/// arrives. An error after the first piece, or a request timeout without one, ends the stream
/// with an `{"error"}` event.
async fn streamed(
    state: Shared,
    connector: std::sync::Arc<dyn rak_core::plugin::Connector>,
    request: Value,
    retrieval: Value,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Result<Response, ApiError> {
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let (done_tx, mut done_rx) = oneshot::channel::<anyhow::Result<Value>>();
    let start = Instant::now();
    let runtime = tokio::runtime::Handle::current();
    let patience = state.opts.request_timeout;
    let (held, watcher) = slot::hold(permit, patience, state.metrics.clone());
    tokio::task::spawn_blocking(move || {
        // A closed channel (the client went away, the stream was cut), or one the client has
        // not read from for a request timeout, tells the connector to stop reading: a client
        // that stops reading must not hold a slot for ever.
        let mut sink = |piece: &str| runtime.block_on(tx.send_timeout(piece.to_string(), patience)).is_ok();
        let result = connector.stream(request, &mut sink);
        // Held until the stream ends (a stream counts toward --target-concurrency
        // throughout), and given back before its end is told, so an ended stream holds none.
        drop(held);
        let _ = done_tx.send(result);
    });
    let mut unanswered = Unanswered(Some((state.metrics.clone(), start)));
    let first = tokio::time::timeout(patience, async {
        tokio::select! {
            biased;
            piece = rx.recv() => Ok(piece),
            done = &mut done_rx => Err(done),
        }
    })
    .await;
    unanswered.0 = None;
    let first = match first {
        Err(_) => {
            state.metrics.observe_upstream(start.elapsed().as_secs_f64(), Some("timeout"));
            return Err(ApiError::timeout(format!("the target LM sent nothing within the request timeout ({:.0} s)", patience.as_secs_f64())));
        }
        Ok(Ok(Some(piece))) => piece,
        // Ended without a piece: a refusal, an error, or an empty stream.
        Ok(Ok(None)) => return finish_stream(&state, start, done_rx.await.ok()),
        Ok(Err(done)) => return finish_stream(&state, start, done.ok()),
    };
    state.metrics.observe_upstream(start.elapsed().as_secs_f64(), None);
    let comment = format!("rak-retrieval {}", serde_json::to_string(&retrieval).unwrap_or_default());
    let head = futures_util::stream::iter([Ok::<Event, Infallible>(Event::default().comment(comment)), Ok(Event::default().data(first))]);
    let pieces = Pieces { rx, done: done_rx, _watcher: watcher, patience, metrics: state.metrics.clone() };
    let rest = futures_util::stream::unfold(Some(pieces), next_piece);
    Ok(Sse::new(futures_util::StreamExt::chain(head, rest)).into_response())
}

/// A stream after its first piece.
struct Pieces {
    rx: mpsc::Receiver<String>,
    done: oneshot::Receiver<anyhow::Result<Value>>,
    /// Dropped with the stream (ended, cut, or its client gone): a call still running then
    /// gets a request timeout more to end before its slot is taken back.
    _watcher: slot::Watcher,
    /// The longest wait for a piece.
    patience: Duration,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
}

/// The next event of a stream: a piece, or after the last one the error that cut it (counted),
/// or the end. A target quiet for a request timeout is cut, as its first piece would have been.
async fn next_piece(next: Option<Pieces>) -> Option<(Result<Event, Infallible>, Option<Pieces>)> {
    let mut p = next?;
    let next = tokio::time::timeout(p.patience, p.rx.recv()).await;
    let err = match next {
        Ok(Some(piece)) => return Some((Ok(Event::default().data(piece)), Some(p))),
        Ok(None) => match p.done.await {
            Ok(Ok(v)) => v.get("error").cloned(),
            Ok(Err(e)) => Some(json!({"kind": "error", "message": format!("{e:#}")})),
            Err(_) => None,
        }?,
        Err(_) => json!({"kind": "timeout", "message": format!("it sent nothing for {:.0} s (the request timeout), so the stream was cut", p.patience.as_secs_f64())}),
    };
    p.metrics.count_upstream_error(err["kind"].as_str().unwrap_or("error"));
    Some((Ok(Event::default().data(json!({"error": upstream_error(&err).body()["error"]}).to_string())), None))
}

/// A stream that ended before its first piece, answered as a whole response.
fn finish_stream(state: &Shared, start: Instant, done: Option<anyhow::Result<Value>>) -> Result<Response, ApiError> {
    match done {
        // A success without a single event: nothing a client reading a stream could use.
        Some(Ok(reply)) if reply.get("error").is_none() && reply.get("body").is_none_or(Value::is_null) => {
            state.metrics.observe_upstream(start.elapsed().as_secs_f64(), Some("bad_reply"));
            Err(ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", "the target LM's stream ended before any event"))
        }
        Some(Ok(reply)) => finish(state, start, reply, |status, body| (status, Json(body)).into_response()),
        Some(Err(e)) => Err(ApiError::new(StatusCode::BAD_GATEWAY, "upstream_error", format!("the target LM failed: {e:#}"))),
        None => Err(ApiError::internal("the streaming call ended without a result")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn passages_go_before_the_last_user_message() {
        let mut r = req(json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Who wrote Hamlet?"}
        ]}));
        assert_eq!(last_user_text(&r).unwrap(), "Who wrote Hamlet?");
        place_passages(&mut r, Route::Chat, "P1\n\n");
        assert_eq!(r["messages"][3]["content"], "P1\n\nWho wrote Hamlet?");
        assert_eq!(r["messages"][1]["content"], "first");
        let mut parts = req(json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]}]}));
        assert_eq!(last_user_text(&parts).unwrap(), "a\nb");
        place_passages(&mut parts, Route::Chat, "P");
        assert_eq!(parts["messages"][0]["content"][0], json!({"type": "text", "text": "P"}));
    }

    #[test]
    fn malformed_messages_name_the_field() {
        for bad in [json!({}), json!({"messages": "hi"}), json!({"messages": [{"content": "x"}]}), json!({"messages": [{"role": "system", "content": "x"}]})] {
            let e = last_user_text(&req(bad.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("messages"), "{bad}");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn upstream_failures_map_to_gateway_statuses() {
        assert_eq!(upstream_error(&json!({"kind": "unreachable", "message": "x"})).status, StatusCode::BAD_GATEWAY);
        assert_eq!(upstream_error(&json!({"kind": "timeout", "message": "x"})).status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(upstream_error(&json!({"kind": "retries_exhausted", "message": "HTTP 503"})).status, StatusCode::BAD_GATEWAY);
        assert_eq!(upstream_error(&json!({"kind": "context_length", "status": 400, "message": "too long"})).status, StatusCode::BAD_REQUEST);
    }
}
