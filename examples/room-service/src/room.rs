//! The room: its state and what each command does to it. Pure code, no I/O:
//! a command either changes a copy of the state and names the event that
//! says so, or is refused.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Mic seats per room.
pub const SEATS: u8 = 8;

/// A room's authoritative state (the seed's Room Cell), stored as JSON in
/// `room_meta.state` next to its version.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoomState {
    /// The room.
    pub room_id: String,
    /// Who created it.
    pub owner: String,
    /// Title.
    pub title: String,
    /// Members present.
    pub members: Vec<String>,
    /// Seat → user.
    pub mics: BTreeMap<u8, String>,
    /// Sum of the gifts sent in the room.
    pub gift_total: i64,
    /// Bumped by every command that changes the room; the outbox event
    /// carries it as `aggregate_version`.
    pub version: i64,
}

/// A command, as the HTTP API takes it: `POST /rooms/{room_id}/{name}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Command {
    /// The caller's id for this command: sent again, it returns the first
    /// result and changes nothing.
    pub command_id: String,
    /// Who acts.
    pub user_id: String,
    /// `create`: the title.
    #[serde(default)]
    pub title: Option<String>,
    /// `mic`: the seat (0-based).
    #[serde(default)]
    pub seat: Option<u8>,
    /// `mic`: `take` or `leave`.
    #[serde(default)]
    pub action: Option<String>,
    /// `sendGift`: who receives it.
    #[serde(default)]
    pub to_user_id: Option<String>,
    /// `sendGift`: the gift.
    #[serde(default)]
    pub gift_id: Option<String>,
    /// `sendGift`: what it costs the sender.
    #[serde(default)]
    pub amount: Option<i64>,
}

/// The command names.
pub const COMMANDS: [&str; 5] = ["create", "join", "mic", "sendGift", "leave"];

/// Why a command was refused: nothing was written.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The command or its fields are wrong (400).
    Invalid(String),
    /// The room does not exist (404).
    NoRoom,
    /// The room's state does not allow it (409).
    Conflict(String),
    /// The wallet's balance is too low (402).
    InsufficientBalance,
}

/// What a command does: the new state and the event that says so.
#[derive(Debug, Clone)]
pub struct Change {
    /// The state after the command (version bumped).
    pub state: RoomState,
    /// `RoomCreated`, `MemberJoined`, `MicTaken`, `MicLeft`, `GiftSent`,
    /// `MemberLeft`.
    pub event_type: &'static str,
    /// The event's payload.
    pub payload: Value,
}

/// A `sendGift`'s debit, asked of the wallet before anything is committed.
#[derive(Debug, Clone, PartialEq)]
pub struct Debit {
    /// Who pays.
    pub user_id: String,
    /// How much.
    pub amount: i64,
}

/// Checks `cmd` against `state` (`None`: no such room yet) and returns the
/// change, without touching `state`.
pub fn decide(
    name: &str,
    room_id: &str,
    state: Option<&RoomState>,
    cmd: &Command,
) -> Result<Change, Refusal> {
    if cmd.command_id.is_empty() || cmd.user_id.is_empty() {
        return Err(Refusal::Invalid(
            "command_id and user_id are required".into(),
        ));
    }
    if name == "create" {
        if state.is_some() {
            return Err(Refusal::Conflict(format!("room {room_id} exists")));
        }
        let title = cmd.title.clone().unwrap_or_default();
        let next = RoomState {
            room_id: room_id.to_owned(),
            owner: cmd.user_id.clone(),
            title: title.clone(),
            members: vec![cmd.user_id.clone()],
            version: 1,
            ..RoomState::default()
        };
        let payload = json!({ "owner": cmd.user_id, "title": title });
        return Ok(change(next, "RoomCreated", room_id, cmd, payload));
    }
    let state = state.ok_or(Refusal::NoRoom)?;
    let mut next = state.clone();
    next.version += 1;
    let member = state.members.contains(&cmd.user_id);
    let (event_type, payload) = match name {
        "join" => {
            if member {
                return Err(Refusal::Conflict(format!("{} is in the room", cmd.user_id)));
            }
            next.members.push(cmd.user_id.clone());
            ("MemberJoined", json!({ "members": next.members.len() }))
        }
        "leave" => {
            if !member {
                return Err(Refusal::Conflict(format!(
                    "{} is not in the room",
                    cmd.user_id
                )));
            }
            next.members.retain(|m| m != &cmd.user_id);
            next.mics.retain(|_, u| u != &cmd.user_id);
            ("MemberLeft", json!({ "members": next.members.len() }))
        }
        "mic" => {
            let seat = cmd
                .seat
                .ok_or_else(|| Refusal::Invalid("mic needs seat".into()))?;
            if seat >= SEATS {
                return Err(Refusal::Invalid(format!(
                    "seat {seat} is not in 0..{SEATS}"
                )));
            }
            if !member {
                return Err(Refusal::Conflict(format!(
                    "{} is not in the room",
                    cmd.user_id
                )));
            }
            match cmd.action.as_deref() {
                Some("take") => {
                    if let Some(holder) = state.mics.get(&seat) {
                        return Err(Refusal::Conflict(format!(
                            "seat {seat} is taken by {holder}"
                        )));
                    }
                    next.mics.retain(|_, u| u != &cmd.user_id);
                    next.mics.insert(seat, cmd.user_id.clone());
                    ("MicTaken", json!({ "seat": seat }))
                }
                Some("leave") => {
                    if state.mics.get(&seat) != Some(&cmd.user_id) {
                        return Err(Refusal::Conflict(format!(
                            "{} is not on seat {seat}",
                            cmd.user_id
                        )));
                    }
                    next.mics.remove(&seat);
                    ("MicLeft", json!({ "seat": seat }))
                }
                _ => return Err(Refusal::Invalid("mic needs action = take or leave".into())),
            }
        }
        "sendGift" => {
            let (Some(to), Some(gift), Some(amount)) = (&cmd.to_user_id, &cmd.gift_id, cmd.amount)
            else {
                return Err(Refusal::Invalid(
                    "sendGift needs to_user_id, gift_id and amount".into(),
                ));
            };
            if amount <= 0 {
                return Err(Refusal::Invalid("amount must be positive".into()));
            }
            if !member || !state.members.contains(to) {
                return Err(Refusal::Conflict(
                    "sender and receiver must be in the room".into(),
                ));
            }
            next.gift_total += amount;
            (
                "GiftSent",
                json!({ "to_user_id": to, "gift_id": gift, "amount": amount }),
            )
        }
        other => {
            return Err(Refusal::Invalid(format!(
                "unknown command `{other}`, use one of {COMMANDS:?}"
            )))
        }
    };
    Ok(change(next, event_type, room_id, cmd, payload))
}

/// The wallet debit `name` needs before it may commit.
pub fn debit_of(name: &str, cmd: &Command) -> Option<Debit> {
    (name == "sendGift").then(|| Debit {
        user_id: cmd.user_id.clone(),
        amount: cmd.amount.unwrap_or(0),
    })
}

fn change(
    state: RoomState,
    event_type: &'static str,
    room_id: &str,
    cmd: &Command,
    mut payload: Value,
) -> Change {
    let fields = payload.as_object_mut().expect("payloads are objects");
    fields.insert("room_id".into(), room_id.into());
    fields.insert("user_id".into(), cmd.user_id.clone().into());
    fields.insert("command_id".into(), cmd.command_id.clone().into());
    fields.insert("version".into(), state.version.into());
    Change {
        state,
        event_type,
        payload,
    }
}
