// Shared by the browser checks: launches headless Chromium (Debian's
// /usr/bin/chromium) in a scratch profile, runs `check(page, result)`,
// prints `result` as JSON on success, or the reason (and `result` so far)
// on stderr with a non-zero exit, and always closes the browser.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

export async function run(name, result, check) {
  const userDataDir = mkdtempSync(join(tmpdir(), "postbox-chromium-"));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    args: [
      "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
  });
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    await check(page, result);
    console.log(JSON.stringify(result));
  } catch (e) {
    console.error(name + " check failed:", e.message);
    console.error(JSON.stringify(result));
    process.exitCode = 1;
  } finally {
    await context.close();
    rmSync(userDataDir, { recursive: true, force: true });
  }
}

// Answers the page's dialogs: a prompt with `token` (counted in
// `result.prompts`), a confirmation with yes (its text kept in
// `result.confirms`).
export function answerDialogs(page, token, result) {
  result.prompts = 0;
  result.confirms = [];
  page.on("dialog", async (d) => {
    if (d.type() === "prompt") {
      result.prompts += 1;
      await d.accept(token);
    } else {
      result.confirms.push(d.message());
      await d.accept();
    }
  });
}
