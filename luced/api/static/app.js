// The page's entry point: chat on the left, status and plots beside it.

import { askForKey } from "./api.js";
import { startChat } from "./chat.js";
import { startPlots } from "./plots.js";
import { startStatus } from "./status.js";

document.getElementById("key-button").addEventListener("click", () => askForKey());
startChat();
startStatus();
startPlots();
