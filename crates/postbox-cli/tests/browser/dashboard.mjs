// Drives the postbox dashboard in headless Chromium. Called by
// crates/postbox-cli/tests/dashboard.rs with a JSON argument:
//   { url, token, app, counts: {status: n}, replay: event_id }
// Checks the counts shown, replays a failed event through its button
// (entering the token at the prompt) and waits for it to leave the failed
// list. Exits non-zero with the reason on any failure.
import { answerDialogs, run } from "./chromium.mjs";

const args = JSON.parse(process.argv[2]);
const initial = { prompts: 0, confirms: [], timeline: [] };
await run("dashboard", initial, async (page, result) => {
  answerDialogs(page, args.token, result);
  const requests = [];
  page.on("request", (r) => requests.push(r.url()));
  await page.goto(args.url, { waitUntil: "load" });

  const cell = (status) => page.locator(`#apps tr[data-app="${args.app}"] td[data-status="${status}"]`);
  for (const [status, n] of Object.entries(args.counts)) {
    await cell(status).filter({ hasText: new RegExp(`^${n}$`) }).waitFor({ timeout: 15000 });
  }
  // The relays, from their heartbeats (all but the time last seen).
  const relay = page.locator(`#relays tr[data-worker="${args.relay}"]`);
  await relay.waitFor({ timeout: 15000 });
  result.relay = (await relay.locator("td").allTextContents()).slice(0, 8);
  // The topology: each event type through each publisher.
  const route = page.locator(`#topology tr[data-event-type="RoomCreated"]`);
  await route.first().waitFor({ timeout: 15000 });
  result.topology = await route.first().locator("td").allTextContents();
  const failedRows = page.locator("#failed tbody tr");
  // The counts render first in a refresh and the failed list after them:
  // wait for the list to follow (up to 20 s), then read it.
  const failedListed = async (n) => {
    await page.waitForFunction(
      (n) => document.querySelectorAll("#failed tbody tr").length === n, n, { timeout: 20000 },
    ).catch(() => {});
    return failedRows.count();
  };
  await failedRows.first().waitFor({ timeout: 15000 });
  result.failed_listed = await failedRows.count();

  // The timeline of the event about to be replayed.
  const row = page.locator(`#failed tr[data-event-id="${args.replay}"]`);
  await row.locator("td").first().click();
  await page.locator("#timeline li").first().waitFor({ timeout: 10000 });
  result.timeline = await page.locator("#timeline li").allTextContents();

  await row.locator("button.replay").click();
  await row.waitFor({ state: "detached", timeout: 15000 });
  result.message = await page.locator("#replay-message").textContent();
  // The counts follow on the server's next poll.
  await cell("failed").filter({ hasText: new RegExp(`^${args.counts.failed - 1}$`) }).waitFor({ timeout: 20000 });
  result.failed_after = await failedListed(args.counts.failed - 1);

  // Search: one event by id (delivered), then the failed ones, replayed in
  // bulk after confirming their count.
  const results = page.locator("#results tbody tr");
  await page.locator("#search input[name=event_id]").fill(args.lookup);
  await page.locator("#search button[type=submit]").click();
  await page.locator(`#results tr[data-event-id="${args.lookup}"]`).waitFor({ timeout: 10000 });
  result.lookup_status = await page.locator(`#results tr[data-event-id="${args.lookup}"] td[data-status]`).textContent();
  await page.locator("#search input[name=event_id]").fill("");
  await page.locator("#search select[name=status]").selectOption("failed");
  await page.locator("#search button[type=submit]").click();
  await page.locator("#results tbody tr td[data-status=failed]").first().waitFor({ timeout: 10000 });
  result.search_failed = await results.count();
  await page.locator("#search-replay").click();
  await page.locator("#replay-message.ok").filter({ hasText: "matching" }).waitFor({ timeout: 15000 });
  await cell("failed").filter({ hasText: /^0$/ }).waitFor({ timeout: 20000 });
  result.failed_at_end = await failedListed(0);

  // Search by aggregate: its events in the app_code, newest first.
  await page.locator("#search select[name=status]").selectOption("");
  await page.locator("#search select[name=app_code]").selectOption(args.app);
  await page.locator("#search input[name=aggregate_id]").fill(args.aggregate);
  await page.locator("#search button[type=submit]").click();
  // The aggregate's three events: a search the page ran after the replay,
  // answered late, must not replace them.
  await page.waitForFunction(
    (ids) => [...document.querySelectorAll("#results tbody tr")].map((r) => r.dataset.eventId).join() === ids.join(),
    args.aggregate_ids,
    { timeout: 10000 },
  ).catch(() => {});
  await page.waitForTimeout(300);
  result.aggregate_rows = await results.evaluateAll((rows) => rows.map((r) => r.dataset.eventId));

  // Runtime controls: pause the app_code from the form, then clear it.
  const form = page.locator("#control-form");
  await form.locator("input[name=app_code]").fill(args.app);
  await form.locator("select[name=paused]").selectOption("true");
  await form.locator("input[name=sample_percent]").fill("25");
  await form.locator("button[type=submit]").click();
  const control = page.locator(`#controls tr[data-app="${args.app}"][data-event-type="*"]`);
  await control.locator('td[data-paused="true"]').waitFor({ timeout: 10000 });
  result.control_log = await page.locator("#control-log li").first().textContent();
  await control.locator("button.clear").click();
  await control.waitFor({ state: "detached", timeout: 10000 });
  result.controls_after = await page.locator("#controls tbody tr").count();
  result.offsite_requests = requests.filter((u) => !u.startsWith(args.url));
});
