// Runs a suite with node's test runner after checking that the npm client is
// installed (scripts/bootstrap does it), so a missing install fails with its fix.
import { existsSync } from 'node:fs';
import { spawnSync } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
if (!existsSync(join(here, 'node_modules', 'openai', 'package.json'))) {
  console.error(`the openai npm package is not installed in ${here}; run scripts/bootstrap (it runs npm ci there)`);
  process.exit(1);
}
// The suites named on the command line (default: proxy.test.mjs).
const suites = process.argv.length > 2 ? process.argv.slice(2) : ['proxy.test.mjs'];
const result = spawnSync(process.execPath, ['--test', '--test-concurrency=1', '--test-reporter=spec',
                                            ...suites.map((s) => join(here, s))], { stdio: 'inherit', cwd: here });
process.exit(result.status ?? 1);
