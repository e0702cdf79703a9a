//! The answer to a request for `n` > 1 choices, or for a list of prompts, from the built-in
//! engines: one stream a choice (sequences of the prompts, each scheduled as its own), merged into
//! OpenAI's one answer — chunks of every choice as they come, each with its `index` (prompt `p`'s
//! choice `i` is `p × n + i`), then one usage for all (each prompt counted once) — or a whole
//! answer with the choices in order. The group is admitted or refused
//! whole, so the first piece of any choice says which; a choice that fails after that (a
//! deadline) fails the request, and the rest are cancelled. The request's outcome is counted
//! here, once: the streams count none.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{BoxStream, SelectAll};
use futures::StreamExt;
use std::time::Instant;

use super::generate::{error, error_event, event};
use super::prompt::{Call, Kind};
use super::shape::{Frame, Gathered};
use super::{Generating, SERVER_TIMING};
use crate::generation::stream::{Finished, Piece, Stream};
use crate::tally::Tally;
use crate::tenants::Held;
use ferry_core::outcome::{Outcome, Refusal};

type Choices = SelectAll<BoxStream<'static, (u64, Piece)>>;

/// Every choice's pieces, each tagged with its index, as they come.
fn merged(streams: Vec<Stream>) -> Choices {
    futures::stream::select_all(streams.into_iter().zip(0u64..).map(|(stream, index)| {
        futures::stream::unfold(stream, move |mut s| async move { s.next().await.map(|p| ((index, p), s)) }).boxed()
    }))
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn answer(
    served: &Generating,
    headers: &HeaderMap,
    call: Call,
    kind: Kind,
    streams: Vec<Stream>,
    mut held: Held,
    tally: Tally,
    arrival: Instant,
) -> Response {
    let n = streams.len();
    let mut frame = Frame::for_request(headers, served.name.clone(), kind, call.sampling.logprobs.is_some())
        .choices_per_prompt(call.n)
        .with_tools(call.tools.clone());
    let mut choices = merged(streams);
    // Nothing is sent before the first token of any choice (or the group's refusal).
    let first = match choices.next().await {
        Some((_, Piece::End(Err(refusal)))) => {
            if matches!(refusal.outcome, Outcome::QueueFull | Outcome::Infeasible) {
                held.refund();
            }
            tally.count(refusal.outcome);
            return error(&refusal);
        }
        Some(first) => first,
        None => return failed(tally),
    };
    let mut ends: Vec<Option<Finished>> = vec![None; n];
    if !call.stream {
        let mut gathered: Vec<Gathered> = (0..n).map(|_| Gathered::default()).collect();
        let mut next = Some(first);
        while let Some((index, piece)) = next {
            match piece {
                Piece::End(Ok(f)) => ends[index as usize] = Some(f),
                Piece::End(Err(refusal)) => {
                    tally.count(refusal.outcome);
                    return error(&refusal);
                }
                piece => gathered[index as usize].add(piece),
            }
            if ends.iter().all(Option::is_some) {
                tally.count(Outcome::Ok);
                let whole = gathered.into_iter().zip(ends.into_iter().flatten()).collect();
                let mut response = (StatusCode::OK, Json(frame.whole_of(whole))).into_response();
                let timing = format!("total;dur={:.1}", ferry_core::clock::elapsed(arrival).as_secs_f64() * 1e3);
                response.headers_mut().insert(SERVER_TIMING, HeaderValue::from_str(&timing).expect("ASCII"));
                return response;
            }
            next = choices.next().await;
        }
        return failed(tally);
    }
    let include_usage = call.include_usage;
    let ttft = ferry_core::clock::elapsed(arrival);
    let opening = match first {
        (index, Piece::End(Ok(f))) => {
            ends[index as usize] = Some(f);
            frame.finish_at(index, &f, include_usage)
        }
        (index, piece) => frame.chunk_at(index, piece, include_usage).expect("the first piece opens the stream"),
    };
    // The tenant's held row and the request's tally travel with the body.
    let state = (choices, frame, ends, Some(tally), held);
    let rest = futures::stream::unfold(state, move |(mut choices, mut frame, mut ends, mut tally, held)| async move {
        let counted = tally.take()?;
        loop {
            if ends.iter().all(Option::is_some) {
                let ends: Vec<Finished> = ends.into_iter().flatten().collect();
                let mut out = Vec::new();
                if include_usage {
                    out.extend_from_slice(&event(&frame.usage_chunk(&ends)));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                counted.count(Outcome::Ok);
                let state = (choices, frame, Vec::new(), None, held);
                return Some((Ok::<Bytes, std::io::Error>(Bytes::from(out)), state));
            }
            let Some((index, piece)) = choices.next().await else {
                counted.count(Outcome::Failed);
                return None;
            };
            let bytes = match piece {
                Piece::End(Ok(f)) => {
                    ends[index as usize] = Some(f);
                    event(&frame.finish_at(index, &f, include_usage))
                }
                Piece::End(Err(refusal)) => {
                    counted.count(refusal.outcome);
                    let state = (choices, frame, Vec::new(), None, held);
                    return Some((Ok(error_event(&refusal)), state));
                }
                piece => match frame.chunk_at(index, piece, include_usage) {
                    Some(chunk) => event(&chunk),
                    None => continue,
                },
            };
            return Some((Ok(bytes), (choices, frame, ends, Some(counted), held)));
        }
    });
    let body = futures::stream::once(async move { Ok::<Bytes, std::io::Error>(event(&opening)) });
    let mut response = Response::new(Body::from_stream(body.chain(rest)));
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    let timing = format!("ttft;dur={:.1}", ttft.as_secs_f64() * 1e3);
    h.insert(SERVER_TIMING, HeaderValue::from_str(&timing).expect("ASCII"));
    response
}

fn failed(tally: Tally) -> Response {
    tally.count(Outcome::Failed);
    error(&Refusal::new(Outcome::Failed, "the generator ended the streams without an answer"))
}
