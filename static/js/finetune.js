// lorafleet fine-tuning pages: the dataset upload's progress bar, and the job page's live part (status, loss
// chart, events), fetched again every two seconds while the job is active. Plain JavaScript, no inline script
// (Content-Security-Policy); every page also works without it.
(function () {
  "use strict";

  function formatBytes(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(2) + " GB";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + " MB";
    if (n >= 1e3) return (n / 1e3).toFixed(1) + " kB";
    return n + " B";
  }

  function setupDatasetUpload(form) {
    var wrap = form.querySelector("#dataset-progress-wrap");
    var bar = form.querySelector("#dataset-progress");
    var percent = form.querySelector("#dataset-percent");
    var bytes = form.querySelector("#dataset-bytes");
    var errorBox = form.querySelector("#dataset-error");
    var result = form.querySelector("#dataset-result");
    var button = form.querySelector("#dataset-button");

    function showError(message) {
      errorBox.hidden = false;
      errorBox.innerHTML = "<strong>Dataset refused.</strong> ";
      errorBox.appendChild(document.createTextNode(message));
    }

    form.addEventListener("submit", function (event) {
      if (!window.XMLHttpRequest || !window.FormData) return;  // plain form post
      event.preventDefault();
      errorBox.hidden = true; result.hidden = true;
      var xhr = new XMLHttpRequest();
      xhr.open("POST", form.action);
      xhr.setRequestHeader("Accept", "application/json");
      var csrf = form.querySelector('input[name="csrfmiddlewaretoken"]');
      if (csrf) xhr.setRequestHeader("X-CSRFToken", csrf.value);  // a body cut at the cap still passes CSRF
      wrap.hidden = false; bar.value = 0; percent.textContent = "0%"; button.disabled = true;
      xhr.upload.addEventListener("progress", function (e) {
        if (!e.lengthComputable) return;
        var p = Math.round(100 * e.loaded / e.total);
        bar.value = p; percent.textContent = p + "%";
        bytes.textContent = formatBytes(e.loaded) + " of " + formatBytes(e.total);
      });
      xhr.upload.addEventListener("load", function () {
        bar.value = 100; percent.textContent = "100%"; bytes.textContent = "uploaded — checking every line…";
      });
      xhr.addEventListener("load", function () {
        button.disabled = false;
        var data = null;
        try { data = JSON.parse(xhr.responseText); } catch (e) { /* not JSON */ }
        if (xhr.status === 201 && data && data.ok) {
          bytes.textContent = "done";
          result.hidden = false;
          result.textContent = data.message + " ";
          var link = document.createElement("a");
          link.href = data.url; link.textContent = "Start a job with it →"; link.id = "dataset-continue";
          result.appendChild(link);
          result.setAttribute("data-file", data.id);
        } else {
          bytes.textContent = "";
          showError(data && data.error ? data.error : xhr.status === 403 ?
            "Your role may not upload datasets, or your session has expired — reload the page." :
            "The upload failed (HTTP " + xhr.status + "). Try again.");
        }
      });
      xhr.addEventListener("error", function () {
        button.disabled = false;
        showError("The connection broke during the upload. Try again.");
      });
      xhr.send(new FormData(form));
    });
  }

  function setupLive(box) {
    var url = box.getAttribute("data-live-url");
    function poll() {
      if (!box.hasAttribute("data-active")) return;
      var xhr = new XMLHttpRequest();
      xhr.open("GET", url);
      xhr.addEventListener("load", function () {
        if (xhr.status === 200) {
          box.innerHTML = xhr.responseText;  // our own server-rendered fragment: no script in it
          var status = box.querySelector("#job-status");
          var state = status ? status.getAttribute("data-status") : "";
          if (state === "succeeded" || state === "failed" || state === "cancelled") {
            box.removeAttribute("data-active");
            var cancel = document.getElementById("cancel-form");
            if (cancel) cancel.hidden = true;
            return;
          }
        }
        setTimeout(poll, 2000);
      });
      xhr.addEventListener("error", function () { setTimeout(poll, 5000); });
      xhr.send();
    }
    setTimeout(poll, 2000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form[data-dataset-upload]").forEach(setupDatasetUpload);
    document.querySelectorAll("[data-live-url]").forEach(setupLive);
  });
})();
