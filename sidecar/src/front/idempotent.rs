//! The path of a request with an `idempotency-key` (the IETF draft's header, as Stripe and
//! others use it): the first caller's request runs detached from its connection, so that a retry
//! after a dropped connection finds its outcome; callers with the same key meanwhile wait for that
//! outcome; later ones get it replayed (`idempotent-replayed: true`); another request under the
//! same key is a 409. Keys are scoped per tenant: the tenant's name with a tenants file, else the
//! hashed `Authorization` header.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::Response;

use super::admit::{process, refuse, Incoming};
use super::{binary, error, Shared, BATCH_SIZE, SERVER_TIMING};
use crate::idempotency::{self, Claim, Key, Saved};
use crate::tally::Tally;
use crate::tenants::Tenant;
use ferry_core::outcome::{Outcome, Refusal};

/// Runs a request under its `idempotency-key` when it has one; `path` is part of what the key
/// promises (with the method and body).
pub(super) async fn call(front: Shared, request: Incoming, mut tally: Tally, path: &str) -> Response {
    let tenant = match front.authenticate(&request.headers, &mut tally) {
        Ok(tenant) => tenant,
        Err(refusal) => return refuse(tally, refusal),
    };
    match request.headers.get(idempotency::KEY_HEADER).cloned() {
        None => process(&front, &request, &tenant, tally).await,
        Some(key) => keyed(front, request, tenant, tally, &key, path).await,
    }
}

/// Runs a request under its `idempotency-key`: the first caller's request runs detached from its
/// connection (so that a retry after a dropped connection finds its outcome), joiners wait for
/// that outcome, later callers get it replayed, and another request under the same key is a 409.
async fn keyed(
    front: Shared,
    request: Incoming,
    tenant: Arc<Tenant>,
    tally: Tally,
    key: &HeaderValue,
    path: &str,
) -> Response {
    let Incoming { bytes, arrival, .. } = &request;
    let key = match key.to_str() {
        Ok(k) if !k.is_empty() && k.len() <= 255 && k.bytes().all(|b| b.is_ascii_graphic()) => k.to_owned(),
        _ => {
            return refuse(
                tally,
                Refusal::invalid(format!(
                    "{} must be 1 to 255 visible ASCII characters; got {} bytes",
                    idempotency::KEY_HEADER,
                    key.len()
                )),
            )
        }
    };
    // Keys are scoped per tenant: its name with a tenants file (a rotated token keeps the scope);
    // without one, the caller's credentials as a gateway in front checked them, hashed (never
    // stored in clear), so that two callers never see each other's answers.
    let scope = if front.tenants.is_configured() {
        format!("tenant:{}", tenant.name)
    } else {
        request
            .headers
            .get(header::AUTHORIZATION)
            .map(|v| {
                let f = idempotency::fingerprint("", "", v.as_bytes());
                f.iter().map(|b| format!("{b:02x}")).collect()
            })
            .unwrap_or_default()
    };
    let record = Key { scope, key: key.clone() };
    let fingerprint = idempotency::fingerprint("POST", path, bytes);
    let claim =
        front.idempotency.lock().unwrap_or_else(|p| p.into_inner()).claim(record.clone(), fingerprint, *arrival);
    let (mut outcome, joiner) = match claim {
        Claim::Conflict => {
            let message = format!(
                "{} '{key}' was already used for a different request (method, path or body differ); use a new key",
                idempotency::KEY_HEADER
            );
            return refuse(tally, Refusal::new(Outcome::Conflict, message));
        }
        Claim::Replay(saved) => {
            tally.count(Outcome::Replayed);
            return replay(&saved, true);
        }
        // A joiner's tally waits with it: `replayed` when the first one's answer comes, or
        // `cancelled` if it goes away first.
        Claim::Join(rx) => (rx, Some(tally)),
        Claim::Execute(rx) => {
            let front = front.clone();
            // The request runs detached, its tally with it: it counts once, whatever its caller does.
            tokio::spawn(async move {
                let response = process(&front, &request, &tenant, tally).await;
                let saved = save(response).await;
                front.idempotency.lock().unwrap_or_else(|p| p.into_inner()).finish(&record, saved);
            });
            (rx, None)
        }
    };
    let saved = outcome.wait_for(Option::is_some).await.ok().and_then(|saved| saved.clone());
    let replayed = joiner.is_some();
    if let Some(tally) = joiner {
        tally.count(if saved.is_some() { Outcome::Replayed } else { Outcome::Failed });
    }
    match saved {
        Some(saved) => replay(&saved, replayed),
        None => {
            error(&Refusal::new(Outcome::Failed, "the request holding this idempotency-key ended without an answer"))
        }
    }
}

/// The headers of a response worth replaying.
const SAVED_HEADERS: [HeaderName; 5] =
    [header::CONTENT_TYPE, header::RETRY_AFTER, BATCH_SIZE, SERVER_TIMING, binary::HEADER];

async fn save(response: Response) -> Saved {
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let headers =
        SAVED_HEADERS.iter().filter_map(|name| parts.headers.get(name).map(|v| (name.clone(), v.clone()))).collect();
    Saved { status: parts.status, headers, body }
}

fn replay(saved: &Saved, replayed: bool) -> Response {
    let mut response = Response::new(Body::from(saved.body.clone()));
    *response.status_mut() = saved.status;
    let h = response.headers_mut();
    for (name, value) in &saved.headers {
        h.insert(name.clone(), value.clone());
    }
    if replayed {
        h.insert(idempotency::REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}
