//! The regional allocator's upstream driver: a tokio task that calls
//! [`RegionalCore::poll_transmit`](crate::regional::RegionalCore::poll_transmit)
//! when it is due (or when a child could not be served), sends the batch to
//! the parent over gRPC with a timeout, and feeds the reply or the failure
//! back. All decisions are in the sans-IO core; this only moves messages and
//! sleeps.

use std::sync::Arc;
use std::time::Duration;

use quotalease_proto::follow::LeaderClient;
use quotalease_proto::lease::LeaseBatch;
use tonic::transport::{Channel, Endpoint};

use crate::server::Shared;

/// The parent as the upstream loop reaches it: its first contact, then
/// whichever replica the replies name as leader (SPEC §7).
pub type Parent = Arc<LeaderClient>;

/// A lazily connecting client for the parent at `url` (the regional starts
/// even if the parent does not answer yet). `timeout` bounds each call.
/// Over mTLS with `tls` when given (the URL is then `https://`).
pub fn client(
    url: &str,
    timeout: Duration,
    tls: Option<&Arc<quotalease_tls::ClientTls>>,
) -> Result<Parent, String> {
    let tls = tls.cloned();
    let connect = move |url: &str| {
        quotalease_tls::channel(endpoint(url, timeout)?, url, tls.as_ref(), "--parent")
    };
    let first = connect(url)?;
    Ok(Arc::new(LeaderClient::new(
        vec![(url.to_string(), first)],
        Arc::new(connect),
    )?))
}

/// The endpoint for the parent at `url`: the common allocator client
/// settings ([`quotalease_model::endpoint::settings`]) with connect and call
/// timeouts of `timeout`. A test connects it over its own network
/// (`Endpoint::connect_with_connector_lazy`) and passes the channel to
/// [`client_on`].
pub fn endpoint(url: &str, timeout: Duration) -> Result<Endpoint, String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!(
            "--parent: {url:?} is not a valid URL: expected http://HOST:PORT"
        ));
    }
    quotalease_proto::endpoint(url, &quotalease_model::endpoint::settings(timeout))
        .map_err(|e| format!("--parent: {url:?} is not a valid URL: {e}"))
}

/// A client for the parent over `channel` (a test's own network); the
/// replicas its replies name are reached over the real network.
pub fn client_on(channel: Channel) -> Parent {
    let connect = |url: &str| Ok(endpoint(url, Duration::from_secs(2))?.connect_lazy());
    Arc::new(
        LeaderClient::new(vec![("parent".into(), channel)], Arc::new(connect))
            .expect("one channel"),
    )
}

/// Send one batch and feed the outcome back to the core, waiting at most
/// `wait`.
async fn exchange(shared: &Shared, client: &LeaderClient, batch: LeaseBatch, wait: Duration) {
    let seq = batch.header.as_ref().map_or(0, |h| h.seq);
    // Log the first failure after a success at warn, repeats at debug.
    let was_reachable = shared
        .with_regional(|r| r.parent_reachable())
        .unwrap_or(false);
    let res = tokio::time::timeout(wait, client.lease(batch)).await;
    let now = shared.now();
    match res {
        Ok(Ok(reply)) => {
            shared.with_regional(|r| r.handle_reply(now, &reply));
            // Its pools may lend more (or less) now.
            shared.slots_changed();
            if !was_reachable {
                tracing::info!("parent allocator reachable");
            }
        }
        Ok(Err(why)) => {
            if was_reachable {
                tracing::warn!(seq, %why, "parent allocator call failed");
            } else {
                tracing::debug!(seq, %why, "parent allocator call failed");
            }
            shared.with_regional(|r| r.handle_failure(now, seq));
        }
        Err(_) => {
            if was_reachable {
                tracing::warn!(seq, ?wait, "parent allocator call timed out");
            } else {
                tracing::debug!(seq, ?wait, "parent allocator call timed out");
            }
            shared.with_regional(|r| r.handle_timeout(now));
        }
    }
}

/// The upstream loop, a pump of the regional core: poll; a batch goes out
/// and the next poll follows its outcome; otherwise sleep until the
/// core's `poll_timeout` or until a child finds a pool dry. Returns
/// when `stop` turns true (or at once for a global allocator).
pub async fn run(
    shared: Arc<Shared>,
    client: Parent,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        if *stop.borrow() {
            return;
        }
        let now = shared.now();
        start_slot_wakes(&shared, &client, now);
        let Some((polled, wake)) =
            shared.with_regional(|r| (r.poll_transmit(now), r.poll_timeout(now)))
        else {
            return;
        };
        if let Some(mut batch) = polled {
            // A batch goes out and the next poll follows its outcome;
            // while a heartbeat is out, a child waiting for a key to be
            // opened polls at once: a batch opening it supersedes the
            // heartbeat (whose answer the core then ignores).
            loop {
                let heartbeat = batch.items.is_empty();
                // The core's deadline for the batch bounds the wait.
                let deadline = shared.with_regional(|r| r.upstream_deadline()).flatten();
                let wait = Duration::from_nanos(deadline.unwrap_or(0).saturating_sub(shared.now()));
                let exchanged = exchange(&shared, &client, batch, wait);
                tokio::pin!(exchanged);
                let superseded = loop {
                    tokio::select! {
                        _ = &mut exchanged => break None,
                        _ = shared.upstream_wanted(), if heartbeat => {
                            let now = shared.now();
                            if let Some(Some(b)) = shared.with_regional(|r| r.poll_transmit(now)) {
                                break Some(b);
                            }
                        }
                        _ = stop.wait_for(|s| *s) => return,
                    }
                };
                match superseded {
                    Some(b) => batch = b,
                    None => break,
                }
            }
            continue;
        }
        let sleep = Duration::from_nanos(wake.saturating_sub(shared.now()));
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = shared.upstream_wanted() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// `WaitSlots` wake-ups of the parent for the slot chains that want one
/// (docs/permits.md "Slots follow demand"): a task each, whose answer
/// goes to the core, and the upstream loop looks at once when it says
/// room grew or someone misses slots.
fn start_slot_wakes(shared: &Arc<Shared>, client: &Parent, now: u64) {
    let Some((wakes, fetch)) =
        shared.with_regional(|r| (r.slot_wakes(now), r.config().fetch_timeout_ns))
    else {
        return;
    };
    for (key, want) in wakes {
        let w = quotalease_proto::lease::SlotWait {
            rule_id: key.rule().to_string(),
            tenant: key.tenant().to_string(),
            route: key.route().to_string(),
            room: want.room,
            contended: want.contended,
            // Within the channel's call timeout (the fetch timeout).
            wait_ms: (fetch / 1_000_000 * 4 / 5).clamp(20, 1_000) as u32,
            shard: 0,
            ..Default::default()
        };
        let (shared, client) = (shared.clone(), client.clone());
        tokio::spawn(async move {
            let answer =
                tokio::time::timeout(Duration::from_nanos(fetch), client.wait_slots(w)).await;
            let (served, room, contended) = match answer {
                Ok(Ok(a)) if !a.not_here => {
                    (true, want.room && a.room > 0, want.contended && a.contended)
                }
                _ => (false, false, false),
            };
            let now = shared.now();
            let look = shared
                .with_regional(|r| r.on_slot_wake(now, &key, served, room, contended))
                .unwrap_or(false);
            if look {
                // The pool may say contended to its children now too.
                shared.slots_changed();
                shared.wake_upstream();
            }
        });
    }
}

/// At shutdown: stop sub-leasing and give the pools back to the parent
/// (one batch, bounded by `timeout`).
pub async fn shutdown(shared: &Shared, client: &LeaderClient, timeout: Duration) {
    let now = shared.now();
    let Some(Some(batch)) = shared.with_regional(|r| r.shutdown(now)) else {
        return;
    };
    let items = batch.items.len();
    exchange(shared, client, batch, timeout).await;
    tracing::info!(items, "gave the unused pools back to the parent");
}
