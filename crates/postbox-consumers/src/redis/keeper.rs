//! Keeps the entries a consumer is working on from being claimed by another
//! consumer of the group while its handler runs.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::RedisError;

use super::topology::connect_answering_within;

/// Resets the idle time (`XCLAIM … 0 … JUSTID`, no delivery counted) of the
/// entries in `ARGV[3..]` that group `ARGV[1]` still has pending for
/// consumer `ARGV[2]`; returns the others (now another consumer's, or no
/// longer pending). Atomic: an entry another consumer has claimed is never
/// taken back.
const KEEP_IF_MINE: &str = r"
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
";

/// Keeps the entries a consumer is working on from a thread of its own, with
/// its own connection and runtime: a handler that blocks its thread or
/// stalls its task cannot stop the keep-alive, so no other consumer takes
/// the entries for due retries while they are being worked on. It refreshes
/// only entries still pending for this consumer ([`KEEP_IF_MINE`]) and
/// notes the ones another consumer now owns.
pub(super) struct Keeper {
    shared: Arc<Kept>,
    /// Dropped with the keeper: the thread ends.
    _stop: tokio::sync::oneshot::Sender<()>,
}

#[derive(Default)]
struct Kept {
    in_hand: std::sync::Mutex<Vec<String>>,
    lost: std::sync::Mutex<std::collections::HashSet<String>>,
}

fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Keeper {
    /// Starts the thread; it touches the entries in hand every `every`.
    pub(super) fn start(
        url: String,
        stream: String,
        group: String,
        name: String,
        every: Duration,
    ) -> Result<Self, String> {
        let shared = Arc::new(Kept::default());
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let kept = shared.clone();
        // A keep answered later than the next is due is of no use.
        let answer = every.clamp(Duration::from_millis(250), Duration::from_secs(5));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("starting the keep-alive runtime: {e}"))?;
        std::thread::Builder::new()
            .name(format!("postbox-keep-{name}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let mut conn: Option<ConnectionManager> = None;
                    loop {
                        tokio::select! {
                            _ = &mut stopped => return,
                            _ = tokio::time::sleep(every) => {}
                        }
                        let ids = locked(&kept.in_hand).clone();
                        if ids.is_empty() {
                            continue;
                        }
                        // A failed keep is tried once more at once, on a
                        // new connection: the one kept idle between
                        // handlers may have been dropped silently on the
                        // way (a NAT or load balancer's idle timeout), and
                        // is never answered again; each wait past `every`
                        // brings the entries closer to being claimed.
                        for fresh in [false, true] {
                            if fresh || conn.is_none() {
                                conn = None;
                                match connect_answering_within(&url, answer).await {
                                    Ok(c) => conn = Some(c),
                                    Err(e) => {
                                        tracing::warn!(error = %e, "could not connect to keep the entries in hand");
                                        break;
                                    }
                                }
                            }
                            let Some(c) = conn.as_mut() else { break };
                            match keep_if_mine(c, &stream, &group, &name, &ids).await {
                                Ok(lost) => {
                                    locked(&kept.lost).extend(lost);
                                    break;
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e, again = !fresh, "could not keep the entries in hand");
                                }
                            }
                        }
                    }
                });
            })
            .map_err(|e| format!("starting the keep-alive thread: {e}"))?;
        Ok(Keeper {
            shared,
            _stop: stop,
        })
    }

    /// The entries to keep from now on (empty: none).
    pub(super) fn hold(&self, ids: &[String]) {
        *locked(&self.shared.in_hand) = ids.to_vec();
        locked(&self.shared.lost).retain(|id| ids.contains(id));
    }

    /// Whether the keep-alive found `id` owned by another consumer (or no
    /// longer pending).
    pub(super) fn was_lost(&self, id: &str) -> bool {
        locked(&self.shared.lost).contains(id)
    }
}

pub(super) async fn keep_if_mine(
    conn: &mut ConnectionManager,
    stream: &str,
    group: &str,
    name: &str,
    ids: &[String],
) -> Result<Vec<String>, RedisError> {
    redis::cmd("EVAL")
        .arg(KEEP_IF_MINE)
        .arg(1)
        .arg(stream)
        .arg(group)
        .arg(name)
        .arg(ids)
        .query_async(conn)
        .await
}
