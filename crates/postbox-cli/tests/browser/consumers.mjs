// Drives the consumers part of the postbox dashboard (served by `postbox
// consume`) in headless Chromium. Called by crates/postbox-cli/tests/it/
// consume.rs with a JSON argument: { url, token, consumer, replay }.
// Pauses and resumes the consumer, lists its dead letters, replays one
// (confirming the count the dashboard asks about) and waits for it to come
// back dead (the handler refuses it again), then purges them all. Exits
// non-zero with the reason on any failure.
import { answerDialogs, run } from "./chromium.mjs";

const args = JSON.parse(process.argv[2]);
const initial = { prompts: 0, confirms: [], states: [] };
await run("consumers dashboard", initial, async (page, result) => {
  answerDialogs(page, args.token, result);
  const requests = [];
  page.on("request", (r) => requests.push(r.url()));
  await page.goto(args.url, { waitUntil: "load" });

  const row = page.locator(`#consumers tr[data-consumer="${args.consumer}"]`);
  await row.waitFor({ timeout: 15000 });
  const state = row.locator("td[data-state]");
  result.states.push(await state.textContent());
  result.outbox_hidden = await page.locator("section.outbox:not([hidden])").count() === 0;
  // The rate shows from the second reading on (a number, never NaN).
  await page.waitForFunction((name) => {
    const td = document.querySelector(`#consumers tr[data-consumer="${name}"] td[data-rate]`);
    return td && /^\d+\.\d$/.test(td.textContent);
  }, args.consumer, { timeout: 15000 });

  await row.locator("button.switch").click();
  await page.locator(`#consumers tr[data-consumer="${args.consumer}"] td[data-state="paused"]`).waitFor({ timeout: 15000 });
  result.states.push("paused");
  await row.locator("button.switch").click();
  await page.locator(`#consumers tr[data-consumer="${args.consumer}"] td[data-state="consuming"]`).waitFor({ timeout: 15000 });
  result.states.push("consuming");

  await row.locator("button.dead").click();
  const letters = page.locator("#dead tbody tr");
  await letters.first().waitFor({ timeout: 15000 });
  result.dead_listed = await letters.count();

  const replayed = page.locator(`#dead tr[data-event-id="${args.replay}"]`);
  result.position_before = (await replayed.locator("td").first().textContent()).trim();
  await replayed.locator("button.dead-replay").click();
  // The replay's own message: the one before (the resume's) is `.ok` too.
  await page.waitForFunction(() => {
    const m = document.querySelector("#replay-message.ok");
    return m && m.textContent.startsWith("Replayed ");
  }, null, { timeout: 15000 });
  result.message = await page.locator("#replay-message").textContent();
  // The handler refuses it again: it comes back dead, behind the others.
  const deadline = Date.now() + 20000;
  for (;;) {
    await page.locator("#dead-reload").click();
    await page.waitForTimeout(300);
    const back = page.locator(`#dead tr[data-event-id="${args.replay}"] td:first-child`);
    if ((await back.count()) === 1 && (await back.textContent()).trim() === String(result.dead_listed)) break;
    if (Date.now() > deadline) throw new Error("the replayed letter never came back dead");
  }

  await page.locator("#dead-purge-all").click();
  await page.locator("#dead-empty:not([hidden])").waitFor({ timeout: 15000 });
  result.dead_after = await letters.count();
  result.offsite_requests = requests.filter((u) => !u.startsWith(args.url));
});
