"""Headless Chromium loads the chat page, sends a message, sees a streamed reply."""

import shutil
import tempfile

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="apt-get install chromium chromium-driver")
def test_page_streams_a_reply(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    profile = tempfile.mkdtemp(prefix="slipstream-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}",
    ]:
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        driver.get(server.base + "/")
        assert "slipstream" in driver.title
        box = driver.find_element(By.ID, "input")
        box.send_keys("And it came to pass")
        driver.find_element(By.ID, "maxtok").clear()
        driver.find_element(By.ID, "maxtok").send_keys("24")
        driver.find_element(By.ID, "send").click()
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done]"))
        reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .content").text
        stats = driver.find_element(By.ID, "stats").text
        assert reply.strip(), "an empty reply"
        assert "tok/s" in stats and "expert cache hit" in stats, stats
        # History: the user message and the reply are on the page.
        assert len(driver.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1
        driver.save_screenshot(tempfile.gettempdir() + "/slipstream-chat-page.png")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
