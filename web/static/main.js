/* anectypes dashboard: the entry of both pages (ES modules, no build step, no external requests).
   The page is served with CSP default-src 'self': no inline scripts or style attributes. The body's
   data-page says which page this is. */

import { smooth } from "./charts.js";
import { flatten } from "./format.js";
import { RunPage } from "./run-page.js";
import { RunsPage } from "./runs-page.js";

const page = document.body.dataset.page;
if (page === "run") window.anectypesPage = new RunPage(document.body.dataset.runId);
else if (page === "index") window.anectypesPage = new RunsPage();
window.anectypesPage?.start();
window.anectypes = { smooth, flatten };
