"""`host serve`'s page in a real browser (tests/serve.rs): Debian's chromium, headless,
driven by selenium through chromium-driver. Types a question, asks, waits for the passages
and prints their titles as one JSON line."""
import json
import shutil
import sys

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

url = sys.argv[1]
driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
options = webdriver.ChromeOptions()
options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(driver_path), options=options)
try:
    driver.set_page_load_timeout(60)
    driver.get(url + "/")
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: "passages" in d.find_element(By.ID, "about").text)
    box = driver.find_element(By.ID, "q")
    box.send_keys("Who founded the Roman Empire?")
    k = driver.find_element(By.ID, "k")
    k.clear()
    k.send_keys("3")
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(ec.presence_of_all_elements_located((By.CSS_SELECTOR, "#passages .passage")))
    titles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#passages .passage .title")]
    errors = driver.find_element(By.ID, "error").text
    print(json.dumps({"titles": titles, "error": errors}))
finally:
    driver.quit()
